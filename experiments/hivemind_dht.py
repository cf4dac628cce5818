"""``python -m experiments.hivemind_dht --host H``: a hivemind bootstrap node as a process.

The hivemind counterpart of ``peer dht`` for experiments with ``backend = "hivemind"``: prints
its first multiaddr on the first line of stdout, then serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading

from peer.hivemind.backend import HivemindBootstrap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.hivemind_dht")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--announce-host", default=None, help="IPv4 address others dial")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with HivemindBootstrap(args.host) as bootstrap:
        address = bootstrap.address
        if args.announce_host:  # /ip4/0.0.0.0/tcp/PORT/p2p/ID -> the address others can reach
            address = re.sub(r"^/ip4/[^/]+/", f"/ip4/{args.announce_host}/", address)
        print(address, flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
