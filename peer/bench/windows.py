"""The side of an interleaved benchmark that runs in other processes: process groups paused with
SIGSTOP while the other side is measured and continued with SIGCONT for their own windows.

A whole group of processes (every peer of a swarm with their children) is stopped and continued
together, so inside the swarm nobody sees anybody stall: their clocks jump forward together by the
pause, which stays shorter than the waits a peer cannot floor (an RPC's 5 s) and than its DHT
records' lifetime (20 s); the train benchmark floors the adaptive ones above it
(:meth:`peer.bench.train.TrainBenchConfig.pause_floor_s`). What a window achieved is read from each
process's metrics stream (``--metrics-file``, lines ``t, samples``):
:func:`peer.bench.pairs.rate_between` over the lines written inside the window, after ``settle_s``
(the first moments after a pause, when the peers' estimates of each other are as old as the pause,
are not measured; the baseline gets the same untimed start).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from peer.bench.pairs import rate_between


def signal_groups(pgids: Sequence[int], sig: signal.Signals) -> None:
    """Send ``sig`` to every process group in ``pgids`` (groups already gone are skipped)."""
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


class MetricsFiles:
    """The metrics streams of a few processes, read as they grow: (``t``, ``samples``) per line.

    Args:
        paths: one JSON Lines file per process (a file not created yet counts as empty).
    """

    def __init__(self, paths: Sequence[Path]):
        self.paths = list(paths)
        self._offsets = [0] * len(self.paths)
        self._partial = [""] * len(self.paths)
        self.points: list[list[tuple[float, float]]] = [[] for _ in self.paths]

    def refresh(self) -> None:
        """Read the lines written since the last call (a half-written last line waits)."""
        for index, path in enumerate(self.paths):
            try:
                with path.open("r", encoding="utf-8") as file:
                    file.seek(self._offsets[index])
                    text = file.read()
                    self._offsets[index] = file.tell()
            except FileNotFoundError:
                continue
            lines = (self._partial[index] + text).split("\n")
            self._partial[index] = lines.pop()
            for line in lines:
                if line.strip():
                    record = json.loads(line)
                    self.points[index].append((float(record["t"]), float(record["samples"])))

    def started(self) -> bool:
        """Whether every process has reported samples (each one is training)."""
        self.refresh()
        return all(any(work > 0 for _, work in points) for points in self.points)

    def rate(self, start: float, end: float) -> float | None:
        """Samples per second summed over the processes, between wall times ``start`` and
        ``end`` (None if one of them wrote fewer than two lines in between)."""
        self.refresh()
        rates = [rate_between(points, start, end) for points in self.points]
        return None if any(r is None for r in rates) else sum(rates)


class PausedGroups:
    """A side of :func:`peer.bench.pairs.interleave`: process groups that run only in their
    windows. Call :meth:`pause` once before the first window; :meth:`resume` leaves them
    running (before stopping them for good: a stopped process does not handle SIGTERM).

    Args:
        pgids: the process groups (each peer was started in its own session).
        metrics: their metrics streams.
        settle_s: seconds at the start of each window that are not measured.
    """

    def __init__(self, pgids: Sequence[int], metrics: MetricsFiles, *, settle_s: float):
        self.pgids = list(pgids)
        self.metrics = metrics
        self.settle_s = settle_s

    def pause(self) -> None:
        signal_groups(self.pgids, signal.SIGSTOP)

    def resume(self) -> None:
        signal_groups(self.pgids, signal.SIGCONT)

    def __call__(self, window_s: float) -> float | None:
        """Run for ``window_s`` seconds; returns the samples/s measured after ``settle_s``."""
        start = time.time()
        self.resume()
        try:
            time.sleep(window_s)
        finally:
            self.pause()
        end = time.time()
        return self.metrics.rate(start + self.settle_s, end)
