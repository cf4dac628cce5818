"""The transport's counters are written on the event loop and read from other threads."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from dht.net.transport import MAX_RTT_SAMPLES, ByteCounters

pytestmark = pytest.mark.timeout(60)


def test_the_median_rtt_can_be_read_while_the_loop_records_round_trips():
    """A reader thread against a writer thread: no ``deque mutated during iteration`` (a peer
    of a 24-peer swarm died of it), and every read is a median of recorded values."""
    counters = ByteCounters()
    for i in range(MAX_RTT_SAMPLES):
        counters.add_rtt(f"p{i % 64}", 0.01)
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            counters.add_rtt(f"p{i % 64}", 0.01)
            i += 1

    errors: list[BaseException] = []
    medians: list[float | None] = []
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible
    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(300):
            try:
                medians.append(counters.median_rtt_s(time.monotonic() - 60.0))
            except RuntimeError as e:
                errors.append(e)
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(old_interval)
    assert errors == []
    assert medians and all(m == pytest.approx(0.01) for m in medians)
