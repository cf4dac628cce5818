"""``peer monitor``: the live dashboard of a swarm, from a DHT client node.

Registered by :mod:`peer.cli.main` through :func:`add_monitor_command`, which also hands in the
readers of other backends' swarms (``--backend hivemind``): the monitor reads our DHT itself and
never imports another backend. This module imports only argparse and :mod:`dht.options` at
import time (``peer --help`` stays fast); the rest comes when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, AsyncExitStack

from dht.options import add_network_args, positive_float, positive_int

# Bound on the one read of ``--once``, in seconds (start-up and bootstrap come on top): a script
# asks for one whole frame and gets no second try, where the live view retries every interval
# (on 2 cores shared with 32 peers, a whole read took longer than the live view's 10 s).
ONCE_TIMEOUT_S = 30.0
# How much longer than its read ``--once`` waits for the frame, in seconds.
_ONCE_SLACK_S = 5.0
# (initial peers, run id) -> a context manager whose value is a monitor.records.RecordSource
OpenRecords = Callable[[list[str], str], AbstractContextManager]


def add_monitor_command(sub, *, backends: Mapping[str, OpenRecords] | None = None) -> None:
    """Add ``peer monitor`` to the ``peer`` command's subparsers.

    Args:
        sub: the subparsers.
        backends: readers of other backends' swarms by ``--backend`` name (the native DHT is
            always there).
    """
    backends = dict(backends or {})
    parser = sub.add_parser(
        "monitor",
        help="watch a swarm live in the terminal (q quits)",
        description="Join the swarm's DHT as a client (no server, no training) and show its "
        "peers, progress toward the target batch size, rounds, loss and bottleneck live. "
        "With more peers than the terminal has rows: a summary, peers per epoch, the peers most "
        "behind or slowest and groups per round; arrows, PgUp/PgDn, Home/End (or a) scroll "
        "every peer, Esc goes back. Without a terminal, one plain line per interval.",
    )
    add_network_args(
        parser,
        ("initial_peers", "swarm_key_file", "tls_ca"),
        required=("initial_peers",),
        help_of={
            "initial_peers": "URLs of nodes in the swarm (http://host:port); with --backend "
            "hivemind, libp2p multiaddrs (/ip4/HOST/tcp/PORT/p2p/ID)"
        },
    )
    parser.add_argument(
        "--backend",
        choices=["native", *backends],
        default="native",
        help="the swarm's networking backend (default: native)",
    )
    parser.add_argument("--run-id", default="vp-run", help="the run to watch (default: vp-run)")
    parser.add_argument(
        "--once", action="store_true", help="print one full frame and exit (for scripts)"
    )
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="seconds between reads of the DHT (default: 1)",
    )
    parser.add_argument(
        "--target-batch-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="samples per swarm epoch (default: as the peers publish it)",
    )
    parser.set_defaults(run=lambda args: run_monitor(args, backends))


def run_monitor(args: argparse.Namespace, backends: Mapping[str, OpenRecords]) -> int:
    from dht.errors import ConfigError
    from dht.options import peer_url, read_swarm_key
    from monitor.config import MonitorConfig

    config = MonitorConfig(
        run_id=args.run_id, interval_s=args.interval, target_batch_size=args.target_batch_size
    )
    if args.once:
        config = dataclasses.replace(config, read_timeout_s=ONCE_TIMEOUT_S)
    if args.backend != "native":
        for flag, value in (("--swarm-key-file", args.swarm_key_file), ("--tls-ca", args.tls_ca)):
            if value is not None:
                raise ConfigError(f"{flag}: the {args.backend} backend has no such option")
        opened = backends[args.backend](list(args.initial_peers), args.run_id)
        return watch_from_records(opened, config, once=args.once)
    try:
        urls = [peer_url(url) for url in args.initial_peers]
    except ValueError as e:
        raise ConfigError(f"--initial-peers: {e}") from None
    swarm_key = read_swarm_key(args.swarm_key_file)
    return watch_from_client(urls, config, once=args.once, swarm_key=swarm_key, tls_ca=args.tls_ca)


def _show(app, *, once: bool) -> int:
    """One frame (``--once``; 1 if the read failed) or the live view until q."""
    if not once:
        # Ctrl-C quits even when this process inherited SIGINT ignored (started in the
        # background by a shell, say), as `peer join` and `peer dht`, which set their own handlers
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            app.run()
        finally:
            signal.signal(signal.SIGINT, previous)
        return 0
    view = app.print_once(ONCE_TIMEOUT_S + _ONCE_SLACK_S)
    if view.error:
        sys.stderr.write(f"peer: error: reading the swarm failed: {view.error}\n")
        return 1
    return 0


def watch_from_records(opened: AbstractContextManager, config, *, once: bool) -> int:
    """Watch through another backend's reader: ``opened`` enters into a
    :class:`monitor.records.RecordSource` (e.g. a hivemind DHT client) and closes it on exit."""
    from monitor.app import LiveApp
    from monitor.records import ThreadedSwarmReader

    with opened as records:
        reader = ThreadedSwarmReader(records, config)
        try:
            return _show(LiveApp(reader.submit, config=config, source=records.source), once=once)
        finally:
            reader.close()


def watch_from_client(
    urls: list[str],
    config,
    *,
    once: bool,
    swarm_key: bytes | None = None,
    tls_ca: str | None = None,
) -> int:
    """Open a client node on an event-loop thread, then run the app in this thread."""
    from dht.runtime import EventLoopThread
    from monitor.app import LiveApp
    from monitor.reader import SwarmReader, open_client_node

    loop_thread = EventLoopThread(name="vp-monitor")
    stack = AsyncExitStack()
    try:
        node = loop_thread.run(
            stack.enter_async_context(
                open_client_node(urls, swarm_key=swarm_key, tls_ca_file=tls_ca)
            ),
            timeout_s=ONCE_TIMEOUT_S,
        )
        try:
            reader = SwarmReader(node, config)
            app = LiveApp(
                lambda: loop_thread.submit(reader.read()),
                config=config,
                source=f"via {urls[0]}",
            )
            return _show(app, once=once)
        finally:
            loop_thread.run(stack.aclose(), timeout_s=ONCE_TIMEOUT_S)
    finally:
        loop_thread.close()
