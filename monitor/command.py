"""``peer monitor``: the live dashboard of a swarm, from a DHT client node.

Registered by :mod:`peer.cli` through :func:`add_monitor_command`. This module imports only
argparse and :mod:`peer.cli_args` at import time (``peer --help`` stays fast); the rest comes
when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AsyncExitStack

from peer.cli_args import positive_float, positive_int

# Bound on the one read of ``--once``, in seconds (start-up and bootstrap come on top).
ONCE_TIMEOUT_S = 30.0


def add_monitor_command(sub) -> None:
    """Add ``peer monitor`` to the ``peer`` command's subparsers."""
    parser = sub.add_parser(
        "monitor",
        help="watch a swarm live in the terminal (q quits)",
        description="Join the swarm's DHT as a client (no server, no training) and show its "
        "peers, progress toward the target batch size, rounds, loss and bottleneck live. "
        "Without a terminal, one plain line per interval.",
    )
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="URL",
        help="URLs of nodes in the swarm (http://host:port)",
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
    parser.add_argument(
        "--swarm-key-file",
        default=None,
        metavar="FILE",
        help="shared secret of a private swarm (or env VP_SWARM_KEY)",
    )
    parser.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="CA bundle to verify HTTPS nodes"
    )
    parser.set_defaults(run=run_monitor)


def run_monitor(args: argparse.Namespace) -> int:
    from dht.errors import ConfigError
    from monitor.config import MonitorConfig
    from peer.config import peer_url, read_swarm_key

    try:
        urls = [peer_url(url) for url in args.initial_peers]
    except ValueError as e:
        raise ConfigError(f"--initial-peers: {e}") from None
    config = MonitorConfig(
        run_id=args.run_id, interval_s=args.interval, target_batch_size=args.target_batch_size
    )
    swarm_key = read_swarm_key(args.swarm_key_file)
    return watch_from_client(urls, config, once=args.once, swarm_key=swarm_key, tls_ca=args.tls_ca)


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
            if once:
                view = app.print_once(ONCE_TIMEOUT_S)
                if view.error:
                    sys.stderr.write(f"peer: error: reading the swarm failed: {view.error}\n")
                    return 1
            else:
                app.run()
        finally:
            loop_thread.run(stack.aclose(), timeout_s=ONCE_TIMEOUT_S)
    finally:
        loop_thread.close()
    return 0
