"""``python -m experiments.linkemu.forwarder CONFIG_JSON``: one emulated link's forwarder.

It opens two TAP devices (side ``a`` and side ``b``, each created in the network namespace its
config names, under the name it gives, e.g. ``eth0`` in a peer's namespace and ``v3`` in the
hub's), prints ``ready`` on stdout, then copies Ethernet frames between them, each direction
through its own :class:`~experiments.linkemu.shaper.Shaper`. The devices exist only while this
process holds them: when it ends, they are gone.

It stops on SIGTERM or SIGINT, or when its stdin reaches EOF (the launcher that started it died),
and then writes its counters and CPU time as JSON to ``stats_file`` if the config names one.
Frames are read without blocking and delivered from per-direction FIFOs; ``select`` has
microsecond timeouts (epoll's are whole milliseconds, which would add up to 1 ms per hop).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytun
from pyroute2 import netns

from experiments.linkemu.shaper import LinkShape, Shaper

# Frames read from one device per wake-up before looking at the clock again.
MAX_BATCH = 64
# A frame due within this many seconds is sent now (select's wake-up is never that precise).
EARLY_S = 50e-6
MAX_FRAME_BYTES = 65535
# The network being imitated does not share the peers' CPUs: the forwarder runs ahead of them so
# that a loaded machine delays its wake-ups (and so the emulated delay) as little as possible.
NICENESS = -10


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def open_tap(namespace: str | None, ifname: str) -> pytun.TunTapDevice:
    """A TAP device named ``ifname`` created in ``namespace`` (None: this process's own)."""
    if namespace:
        netns.pushns()
        netns.setns(namespace, flags=0)  # flags=0: never create a namespace that is missing
    try:
        tap = pytun.TunTapDevice(name=ifname, flags=pytun.IFF_TAP | pytun.IFF_NO_PI)
    finally:
        if namespace:
            netns.popns()
    os.set_blocking(tap.fileno(), False)
    return tap


class _Direction:
    """Frames from one device to the other, waiting for their delivery time."""

    def __init__(self, source: int, sink: int, shaper: Shaper):
        self.source, self.sink, self.shaper = source, sink, shaper
        self.pending: collections.deque[tuple[float, bytes]] = collections.deque()
        self.num_write_errors = 0
        self.last_write_error = ""

    def read(self, now_s: float) -> None:
        for _ in range(MAX_BATCH):
            try:
                frame = os.read(self.source, MAX_FRAME_BYTES)
            except BlockingIOError:
                return
            if not frame:
                raise OSError("the device was closed")
            due_s = self.shaper.admit(now_s, len(frame))
            if due_s is not None:
                self.pending.append((due_s, frame))

    def deliver(self, now_s: float) -> float | None:
        """Send what is due; returns when the next frame is due (None: nothing waits)."""
        pending = self.pending
        while pending and pending[0][0] <= now_s + EARLY_S:
            _, frame = pending.popleft()
            try:
                os.write(self.sink, frame)
            except OSError as e:  # the kernel refused it (backlog full, device down): lost
                self.num_write_errors += 1
                self.last_write_error = str(e)
        return pending[0][0] if pending else None


def run(directions: list[_Direction], lifeline: int | None) -> None:
    """Forward until :class:`_Stop` or EOF on ``lifeline``."""
    readers = {d.source: d for d in directions}
    watched = [*readers, *([lifeline] if lifeline is not None else [])]
    while True:
        now_s = time.monotonic()
        dues = [due for d in directions if (due := d.deliver(now_s)) is not None]
        timeout_s = max(0.0, min(dues) - time.monotonic()) if dues else None
        ready, _, _ = select.select(watched, [], [], timeout_s)
        now_s = time.monotonic()
        for fd in ready:
            if fd == lifeline:
                if not os.read(lifeline, 4096):
                    return
            else:
                readers[fd].read(now_s)


def _shape(config: dict[str, Any]) -> LinkShape:
    return LinkShape(**config)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m experiments.linkemu.forwarder CONFIG_JSON\n")
        return 2
    config = json.loads(args[0])
    seed = config.get("seed")
    tap_a = open_tap(config["a"].get("netns"), config["a"]["ifname"])
    tap_b = open_tap(config["b"].get("netns"), config["b"]["ifname"])
    directions = [
        _Direction(tap_a.fileno(), tap_b.fileno(), Shaper(_shape(config["a_to_b"]), seed=seed)),
        _Direction(
            tap_b.fileno(),
            tap_a.fileno(),
            Shaper(_shape(config["b_to_a"]), seed=None if seed is None else seed + 1),
        ),
    ]

    def stop(*_: object) -> None:
        raise _Stop

    try:
        os.setpriority(os.PRIO_PROCESS, 0, NICENESS)
    except PermissionError:
        pass  # not root: an ordinary priority, somewhat less precise delays
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    started_s = time.monotonic()
    lifeline = None if config.get("no_lifeline") else sys.stdin.fileno()
    status = 0
    try:
        run(directions, lifeline)
    except _Stop:
        pass
    except OSError as e:  # a device went away (its namespace was deleted under us)
        sys.stderr.write(f"linkemu forwarder: stopping: {e}\n")
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if config.get("stats_file"):
            _write_stats(Path(config["stats_file"]), directions, time.monotonic() - started_s)
    return status


def _write_stats(path: Path, directions: list[_Direction], wall_s: float) -> None:
    cpu = os.times()
    stats = {
        "wall_s": wall_s,
        "cpu_s": cpu.user + cpu.system,
        "a_to_b": dataclasses.asdict(directions[0].shaper.stats),
        "b_to_a": dataclasses.asdict(directions[1].shaper.stats),
        "num_write_errors": sum(d.num_write_errors for d in directions),
        "last_write_error": " ".join(d.last_write_error for d in directions).strip(),
    }
    path.write_text(json.dumps(stats))


if __name__ == "__main__":
    sys.exit(main())
