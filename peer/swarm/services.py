"""The swarm side of a peer, on its event-loop thread: transport, DHT node, progress tracker,
state server and averager, opened and closed as one unit."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch

from averaging.averager import DecentralizedAverager
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.node import DHTNode
from dht.reachability import settle_reachability
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
    config: PeerConfig,
    identity: PeerIdentity | None = None,
    *,
    tensors: Sequence[torch.Tensor],
    routes: Iterable[Callable[[HttpTransport], None]] = (),
    node: DHTNode | None = None,
) -> SwarmServices:
    """Start everything (handlers are registered before the transport starts serving).

    A node of its own asks its initial peers to dial it back before the DHT node starts
    (:func:`dht.reachability.settle_reachability`): one nobody can dial runs in client mode
    from then on; ``transport.reachability`` says what it learned.

    Args:
        config: the peer's settings.
        identity: its key pair (for a transport and node of its own).
        tensors: what the averager averages in place (the optimizer's fixed buffers).
        routes: each adds its own plain routes to the transport (``GET /metrics``) before it
            serves.
        node: a DHT node already running (a library user's :class:`peer.DHT`): the services
            attach to it, and closing them leaves it running (``routes`` must be empty).
    """
    stack = AsyncExitStack()
    owns_node = node is None
    try:
        if node is None:
            if identity is None:
                raise ValueError("open_services: give identity or a running node")
            transport = HttpTransport(identity, config.transport_config())
            node = DHTNode(transport=transport, identity=identity, config=config.dht_config())
        else:
            transport, routes = node.transport, ()
        prefix = config.run_id
        state_server = StateServer(
            transport=transport, dht=node, prefix=prefix, config=config.state_sync_config()
        )
        tracker = ProgressTracker(dht=node, prefix=prefix, config=config.progress_config())
        averager = DecentralizedAverager(
            tensors,
            transport=transport,
            dht=node,
            prefix=prefix,
            config=config.averager_config(),
        )
        for add_routes in routes:
            add_routes(transport)
        if owns_node:
            await stack.enter_async_context(transport)
            if config.relay_via:  # before the node starts: it joins under its relayed address
                await transport.attach_relay(config.relay_via)
            else:  # who cannot be dialled is relayed by an initial peer, or else a client
                await settle_reachability(
                    transport,
                    config.initial_peers,
                    transport.config.reachability,
                    relays=config.initial_peers,
                )
            await stack.enter_async_context(node)
        await stack.enter_async_context(state_server)
        await tracker.refresh()
        await stack.enter_async_context(tracker)
        await stack.enter_async_context(averager)
    except BaseException:
        await stack.aclose()
        raise
    return SwarmServices(transport, node, tracker, state_server, averager, stack)
