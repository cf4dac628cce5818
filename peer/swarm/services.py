"""The swarm side of a peer, on its event-loop thread: progress tracker, state server and
averager on the peer's transport and DHT node, opened and closed as one unit."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch

from averaging.averager import DecentralizedAverager
from dht.http import HttpTransport
from dht.kademlia.node import DHTNode
from peer.run.config import PeerConfig
from peer.swarm.progress import ProgressTracker
from peer.swarm.state_sync import StateServer


@dataclass
class SwarmServices:
    """What a running peer holds on its event loop (use :func:`open_services`)."""

    transport: HttpTransport
    node: DHTNode
    tracker: ProgressTracker
    state_server: StateServer
    averager: DecentralizedAverager
    stack: AsyncExitStack

    async def close(self) -> None:
        """Leave the swarm: stop publishing, serving and averaging; safe to call twice."""
        await self.stack.aclose()


async def open_services(
    config: PeerConfig, *, tensors: Sequence[torch.Tensor], node: DHTNode
) -> SwarmServices:
    """Attach the swarm's services to a running DHT node (a :class:`peer.DHT`'s, which
    ``peer join`` and the library both start: :func:`dht.launch.open_node` decides there how
    the swarm reaches the peer); closing them leaves the node running.

    Args:
        config: the peer's settings.
        tensors: what the averager averages in place (the optimizer's fixed buffers).
        node: the running DHT node.
    """
    stack = AsyncExitStack()
    transport, prefix = node.transport, config.run_id
    try:
        state_server = StateServer(
            transport=transport, dht=node, prefix=prefix, config=config.state_sync_config()
        )
        tracker = ProgressTracker(dht=node, prefix=prefix, config=config.progress_config())
        # where the announcements go: a bucket picked by the swarm's size as this peer counts it
        state_server.num_peers = lambda: tracker.global_progress.num_peers
        averager = DecentralizedAverager(
            tensors,
            transport=transport,
            dht=node,
            prefix=prefix,
            config=config.averager_config(),
        )
        await stack.enter_async_context(state_server)
        await tracker.refresh()
        await stack.enter_async_context(tracker)
        await stack.enter_async_context(averager)
    except BaseException:
        await stack.aclose()
        raise
    return SwarmServices(transport, node, tracker, state_server, averager, stack)
