"""The swarm side of a library peer: the services of :mod:`peer.swarm.services` (progress
tracker, state server, averager) attached to the node of a running :class:`peer.DHT`, which the
user owns and closes after the optimizer."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass

from torch import nn

from dht.node import DHTNode
from peer.run.config import PeerConfig
from peer.swarm.progress import ProgressTracker
from peer.swarm.services import SwarmServices
from peer.swarm.state_sync import StateServer


async def attach_services(config: PeerConfig, node: DHTNode, make_averager) -> SwarmServices:
    """Start the tracker, state server and averager on ``node`` (its transport already serves;
    handlers added now serve from now on). Closing the result leaves the node running.

    Args:
        config: the settings (run id, progress, state sync).
        node: the started DHT node of the user's :class:`peer.DHT`.
        make_averager: ``(transport, node) -> async context manager`` of the averager.
    """
    stack = AsyncExitStack()
    transport = node.transport
    try:
        prefix = config.run_id
        state_server = StateServer(
            transport=transport, dht=node, prefix=prefix, config=config.state_sync_config()
        )
        tracker = ProgressTracker(dht=node, prefix=prefix, config=config.progress_config())
        averager = make_averager(transport, node)
        await stack.enter_async_context(state_server)
        await tracker.refresh()
        await stack.enter_async_context(tracker)
        await stack.enter_async_context(averager)
    except BaseException:
        await stack.aclose()
        raise
    return SwarmServices(transport, node, tracker, state_server, averager, stack)


@dataclass
class LoopCounts:
    """What :class:`peer.swarm.catch_up.StateCatchUp` reads of a trainer: the model whose state
    is served and loaded, and the counts that go into snapshots."""

    model: nn.Module
    step: int = 0
    total_samples: int = 0


def params_module(params: list[nn.Parameter]) -> nn.Module:
    """A module holding exactly ``params`` (the same tensors), for state sync and snapshots:
    hivemind's API takes parameters, not a model."""
    module = nn.Module()
    module.params = nn.ParameterList(params)
    return module
