"""The dashboard beside something else: a training peer (``peer join --dashboard``), the demo's
bootstrap node (``peer demo``), or a client node of its own (``peer experiment run``).

The :class:`monitor.app.LiveApp` runs in a thread of its own; its reads go to the event loop that
owns the DHT node (the peer's loop thread, or the demo's asyncio loop), so the training thread
and that loop never wait for the screen. Both helpers are context managers whose exit stops the
app, joins its thread and leaves the terminal as it was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager

from rich.console import Console

from dht.config import DHTConfig
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.launch import open_node
from dht.net.config import TransportConfig
from dht.runtime import EventLoopThread
from monitor.app import LiveApp, running_in_thread
from monitor.config import MonitorConfig
from monitor.reader import SwarmReader

# Bound on reaching the initial peers of :func:`client_dashboard`, in seconds.
CONNECT_TIMEOUT_S = 5.0
# Bound on closing its client node, in seconds.
CLOSE_TIMEOUT_S = 10.0


@contextmanager
def peer_dashboard(
    loop_thread: EventLoopThread,
    node: DHTNode,
    *,
    config: MonitorConfig,
    local_peer_id: str,
    on_quit: Callable[[], None],
    console: Console | None = None,
) -> Iterator[LiveApp]:
    """Show the swarm around the local peer until the block ends.

    Args:
        loop_thread: the peer's event-loop thread (it owns ``node``).
        node: the peer's DHT node.
        config: the monitor's settings (run id, intervals).
        local_peer_id: the peer whose own panels (phases, rounds) are shown.
        on_quit: called when the user presses q (stop training).
        console: where to draw (stdout by default).
    """
    reader = SwarmReader(node, config, local_peer_id=local_peer_id)
    app = LiveApp(
        lambda: loop_thread.submit(reader.read()),
        config=config,
        console=console,
        on_quit=on_quit,
        source=f"this peer: {node.address or 'client mode'}",
    )
    with running_in_thread(app):
        yield app


@contextmanager
def swarm_dashboard(
    loop: asyncio.AbstractEventLoop,
    node: DHTNode,
    *,
    config: MonitorConfig,
    on_quit: Callable[[], None],
    console: Console | None = None,
) -> Iterator[LiveApp]:
    """Show the swarm seen through ``node``, which lives on ``loop`` (a running loop in another
    thread, e.g. the caller's own), until the block ends."""
    reader = SwarmReader(node, config)
    app = LiveApp(
        lambda: asyncio.run_coroutine_threadsafe(reader.read(), loop),
        config=config,
        console=console,
        on_quit=on_quit,
        source=f"via {node.address}",
    )
    with running_in_thread(app):
        yield app


async def _join(
    stack: AsyncExitStack,
    initial_peers: list[str],
    connect_timeout_s: float,
    enter_network: Callable[[], None] | None,
) -> DHTNode:
    if enter_network is not None:
        enter_network()  # this coroutine runs in the loop's thread: its sockets go there too
    transport_config = TransportConfig(client_mode=True)
    dht_config = DHTConfig(
        initial_peers=tuple(initial_peers), bootstrap_timeout_s=connect_timeout_s
    )
    return await stack.enter_async_context(
        open_node(PeerIdentity.generate(), transport_config, dht_config)
    )


@contextmanager
def client_dashboard(
    initial_peers: list[str],
    *,
    config: MonitorConfig,
    on_quit: Callable[[], None],
    console: Console | None = None,
    source: str = "",
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    enter_network: Callable[[], None] | None = None,
) -> Iterator[LiveApp]:
    """Join the swarm as a client node (its own event-loop thread, no server) and show it until
    the block ends; the node leaves with the block.

    Args:
        initial_peers: URLs of nodes in the swarm.
        config: the monitor's settings (run id, intervals).
        on_quit: called when the user presses q (the app has stopped drawing by then).
        console: where to draw (stdout by default).
        source: the footer's text (default: the first initial peer).
        connect_timeout_s: bound on reaching ``initial_peers``.
        enter_network: run first in the node's thread, e.g. to enter the network namespace the
            swarm lives in.

    Raises:
        dht.errors.DHTError: none of ``initial_peers`` answered within ``connect_timeout_s``.
        OSError: ``enter_network`` failed.
    """
    loop_thread = EventLoopThread(name="vp-dashboard-loop")
    stack = AsyncExitStack()
    try:
        node = loop_thread.run(
            _join(stack, initial_peers, connect_timeout_s, enter_network),
            timeout_s=connect_timeout_s + CLOSE_TIMEOUT_S,
        )
        reader = SwarmReader(node, config)
        app = LiveApp(
            lambda: loop_thread.submit(reader.read()),
            config=config,
            console=console,
            on_quit=on_quit,
            source=source or f"via {initial_peers[0]}",
        )
        with running_in_thread(app):
            yield app
    finally:
        try:
            loop_thread.run(stack.aclose(), timeout_s=CLOSE_TIMEOUT_S)
        finally:
            loop_thread.close()
