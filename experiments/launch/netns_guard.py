"""``python -m experiments.launch.netns_guard PREFIX PID [ALLOWED]``: deletes a sweep's namespaces
after it dies.

The netns launcher starts one guard per sweep in a session of its own. The guard waits until
process PID is gone (a sweep killed with SIGKILL cannot clean up after itself) or until it is
told to stop (SIGTERM, the sweep's normal end), then deletes every namespace named PREFIX*, and
puts the host's ``tcp_allowed_congestion_control`` back to ALLOWED (comma-separated) if given.
"""

from __future__ import annotations

import signal
import sys
import threading

import psutil

from experiments.launch.netns import allow_congestion_controls, cleanup_all

POLL_S = 0.5


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or not args[1].isdigit():
        sys.stderr.write("usage: python -m experiments.launch.netns_guard PREFIX PID [ALLOWED]\n")
        return 2
    prefix, pid = args[0], int(args[1])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(POLL_S):
        if not _alive(pid):
            break
    cleanup_all(prefix)
    if len(args) == 3:
        allow_congestion_controls(args[2].split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
