"""The benchmarks' method on a noisy host: a CPU hog that switches on and off during the run.

Two identical plain loops (the true ratio of their rates is 1.0), each a process that writes a
metrics stream (``t``, work since the previous line), are compared as ``peer bench train``
compares the baseline and the swarm: in interleaved windows, the side not measured stopped
with SIGSTOP (:class:`peer.bench.windows.PausedGroups`), the median of pairwise ratios
(:func:`peer.bench.pairs.interleave`). Hog processes, twice as many as the machine's cores,
run during the middle half of each measurement: the interleaved ratio stays within 5% of 1.0,
while an A-B-A run of the same length, whose B stretch the hog covers, is far off. Only ratios
of work done are asserted, never a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import pytest

from peer.bench.pairs import aba, interleave
from peer.bench.windows import MetricsFiles, PausedGroups, signal_groups

pytestmark = pytest.mark.timeout(150)
NUM_PAIRS = 12
WINDOW_S = 1.0
ABA_S = 8.0
LINE_S = 0.02

LOOP = f"""
import json, sys, time
out = open(sys.argv[1], "a", buffering=1)
units, next_line = 0, time.monotonic() + {LINE_S}
while True:
    sum(range(2000))  # one unit of work
    units += 1
    if time.monotonic() >= next_line:
        out.write(json.dumps({{"t": time.time(), "samples": units}}) + "\\n")
        units, next_line = 0, time.monotonic() + {LINE_S}
"""
HOG = "while True: pass"


def _start(stack: ExitStack, code: str, *args: str) -> int:
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args], process_group=0, stdout=subprocess.DEVNULL
    )

    def stop() -> None:
        signal_groups([process.pid], signal.SIGKILL)
        process.wait()

    stack.callback(stop)
    signal_groups([process.pid], signal.SIGSTOP)
    return process.pid


class _Hog:
    """Hog processes, stopped except during ``[on_s, off_s]`` after :meth:`run_from` starts."""

    def __init__(self, stack: ExitStack, num_processes: int):
        self.pgids = [_start(stack, HOG) for _ in range(num_processes)]
        stack.callback(self._stop)
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def run_from(self, on_s: float, off_s: float) -> None:
        self._stop()

        def toggle() -> None:
            start = time.monotonic()
            if self._cancel.wait(max(0.0, start + on_s - time.monotonic())):
                return
            signal_groups(self.pgids, signal.SIGCONT)
            self._cancel.wait(max(0.0, start + off_s - time.monotonic()))
            signal_groups(self.pgids, signal.SIGSTOP)

        self._cancel.clear()
        self._thread = threading.Thread(target=toggle)
        self._thread.start()

    def _stop(self) -> None:
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()


@pytest.fixture
def sides(tmp_path):
    with ExitStack() as stack:
        loops = []
        for name in ("a", "b"):
            path = tmp_path / f"{name}.jsonl"
            pgid = _start(stack, LOOP, str(path))
            loops.append(PausedGroups([pgid], MetricsFiles([path]), settle_s=0.05))
        hog = _Hog(stack, 2 * (os.cpu_count() or 1))
        yield loops, hog


def test_interleaved_windows_hold_under_a_hog_that_a_b_a_does_not(sides):
    (a, b), hog = sides
    # the hog runs during the middle half: in A-B-A, exactly while B runs
    hog.run_from(ABA_S / 4, 3 * ABA_S / 4)
    biased = aba(a, b, seconds=ABA_S / 2)
    total_s = 2 * NUM_PAIRS * WINDOW_S
    hog.run_from(total_s / 4, 3 * total_s / 4)
    result = interleave(a, b, num_pairs=NUM_PAIRS, window_s=WINDOW_S)
    spread = result.spread
    assert spread.num_pairs == NUM_PAIRS
    # the hog slowed the windows it covered a lot: it is a real disturbance
    assert min(r for r in result.rates_a if r) < 0.8 * max(r for r in result.rates_a if r)
    print("RESULT", biased, spread.ratio_p50, spread.ratio_iqr, spread.ratios)
    assert abs(spread.ratio_p50 - 1.0) <= 0.05, spread
    assert biased is not None and abs(biased - 1.0) > 0.05, biased
