"""The dashboard beside something else: a training peer (``peer join --dashboard``) or the demo's
bootstrap node (``peer demo``).

The :class:`monitor.app.LiveApp` runs in a thread of its own; its reads go to the event loop that
owns the DHT node (the peer's loop thread, or the demo's asyncio loop), so the training thread
and that loop never wait for the screen. Both helpers are context managers whose exit stops the
app, joins its thread and leaves the terminal as it was.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

from dht.node import DHTNode
from dht.runtime import EventLoopThread
from monitor.app import LiveApp
from monitor.config import MonitorConfig
from monitor.reader import SwarmReader

# Bound on waiting for the app's thread to notice a stop (it polls every 0.1 s).
JOIN_TIMEOUT_S = 10.0


@contextmanager
def _running(app: LiveApp) -> Iterator[LiveApp]:
    thread = threading.Thread(target=app.run, name="vp-dashboard", daemon=True)
    thread.start()
    try:
        yield app
    finally:
        app.stop_event.set()
        thread.join(JOIN_TIMEOUT_S)


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
    with _running(app):
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
    with _running(app):
        yield app
