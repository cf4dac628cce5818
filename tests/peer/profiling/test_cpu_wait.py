"""``cpu_wait``: a thread that is runnable but not running is waiting for a CPU, not computing
and not communicating. Each test pins a thread to one core (``os.sched_setaffinity`` on the
thread itself), with or without a busy process pinned beside it, and checks the profiler's
``cpu_wait`` against an independent reference: for a thread that never sleeps, wall time minus
the thread's own CPU time (``time.thread_time``) is the time it waited for the core."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from peer.profiling.cpu_wait import RunQueueProbe
from peer.profiling.metrics_reader import validate_line
from peer.profiling.profiled_clock import ProfiledClock
from peer.profiling.summary import diagnose

BUSY_S = 1.0
pytestmark = pytest.mark.skipif(
    RunQueueProbe(threading.get_native_id()).wait_s() is None,
    reason="this kernel keeps no per-thread run-queue delay (schedstat)",
)


@contextlib.contextmanager
def busy_process(cpu: int | None):
    """Processes spinning on ``cpu`` (nothing when None)."""
    if cpu is None:
        yield
        return
    # two of them: the measured thread gets about a third of the core
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for process in processes:
            os.sched_setaffinity(process.pid, {cpu})
        time.sleep(0.2)  # they run before the measured thread starts
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=10)


def spin(seconds: float) -> tuple[float, float]:
    """Spin for ``seconds`` of wall time; (wall, this thread's CPU) seconds spent."""
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < seconds:
        pass
    return time.perf_counter() - wall, time.thread_time() - cpu


def in_thread(target):
    result = {}

    def run():
        result["value"] = target()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return result["value"]


def computing_alone_on(cpu: int) -> tuple[dict[str, float], float, float]:
    """A training thread pinned to ``cpu`` spins in ``forward``: its phases, wall and CPU s."""

    def train():
        os.sched_setaffinity(0, {cpu})
        clock = ProfiledClock()  # watches the thread that makes it
        with clock.phase("forward"):
            wall_s, cpu_s = spin(BUSY_S)
        snapshot = clock.snapshot()
        clock.close()
        return snapshot.seconds, wall_s, cpu_s

    return in_thread(train)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("competing", [False, True], ids=["alone", "with-a-busy-process"])
def test_a_computing_thread_that_waits_for_its_core_is_cpu_wait(competing):
    cpu = min(os.sched_getaffinity(0))
    with busy_process(cpu if competing else None):
        seconds, wall_s, cpu_s = computing_alone_on(cpu)
    waited_s = wall_s - cpu_s  # the reference: it never slept
    total_s = sum(seconds.values())
    assert seconds["cpu_wait"] == pytest.approx(waited_s, abs=0.1 * wall_s)
    assert seconds["forward"] + seconds["cpu_wait"] == pytest.approx(wall_s, abs=0.05)
    assert seconds["forward"] >= 0 and seconds["cpu_wait"] <= total_s
    if competing:  # the busy processes take about two thirds of the core
        assert seconds["cpu_wait"] / total_s >= 0.5
        verdict = diagnose(seconds, total_s)  # the work itself is computing
        assert verdict.bottleneck == "compute" and "; CPU contention: runnable" in verdict.text


@pytest.mark.timeout(60)
def test_the_loop_threads_wait_for_a_cpu_in_a_round_is_cpu_wait_not_communication():
    """The training thread sleeps in ``allreduce`` while the event-loop thread does the round;
    the loop thread shares its core with a busy process: its wait is ``cpu_wait``."""
    cpu = min(os.sched_getaffinity(0))
    clock = ProfiledClock()
    loop_ready, started, finished, round_over = (threading.Event() for _ in range(4))
    spent: dict[str, float] = {}

    def loop():
        os.sched_setaffinity(0, {cpu})
        clock.watch_threads(loop=threading.get_native_id())
        loop_ready.set()
        cpu_s = time.thread_time()
        started.wait(timeout=30)  # the round starts: waking up may wait for the core already
        spin(BUSY_S)
        spent["end"], spent["cpu"] = time.perf_counter(), time.thread_time() - cpu_s
        finished.set()
        round_over.wait(timeout=30)  # a loop thread lives on after the round

    def train():
        clock.watch_threads(training=threading.get_native_id())
        with clock.phase("allreduce"):
            spent["start"] = time.perf_counter()
            started.set()
            finished.wait(timeout=30)  # blocked on the round, as on the loop's future
        snapshot = clock.snapshot()
        round_over.set()
        return snapshot

    with busy_process(cpu):
        loop_thread = threading.Thread(target=loop)
        loop_thread.start()
        assert loop_ready.wait(timeout=30)
        snapshot = in_thread(train)
        loop_thread.join(timeout=30)
    clock.close()
    seconds = snapshot.seconds
    assert sum(seconds.values()) == pytest.approx(snapshot.wall_s, rel=1e-9)
    # the reference: from the round's start to the end of its work, the loop thread either ran
    # or waited for the core (it has nothing else to wait for)
    round_s = spent["end"] - spent["start"]
    assert seconds["cpu_wait"] == pytest.approx(round_s - spent["cpu"], abs=0.1 * round_s)
    assert seconds["cpu_wait"] / snapshot.wall_s >= 0.25
    assert clock.cpu_wait_taken()["allreduce"] >= 0.9 * seconds["cpu_wait"]
    assert seconds["allreduce"] + seconds["cpu_wait"] >= round_s


def test_cpu_contention_is_named_but_the_bottleneck_is_the_workloads():
    """The same run on an idle and on a crowded host gets the same bottleneck."""
    verdict = diagnose({"cpu_wait": 0.5, "allreduce": 0.3, "forward": 0.2}, 1.0)
    assert verdict.bottleneck == "communication"
    assert verdict.text.startswith("communication bound: all-reduce 60%")
    assert verdict.text.endswith(
        "; CPU contention: runnable but waiting for a CPU 50% of wall time; run fewer processes "
        "or threads (--torch-threads) than the machine has cores"
    )
    for cpu_wait_s in (0.0, 0.1, 0.37, 0.6, 0.9):
        scale = 1.0 - cpu_wait_s  # the rest keeps the idle run's proportions
        computing = {"cpu_wait": cpu_wait_s, "forward": 0.8 * scale, "data": 0.2 * scale}
        assert diagnose(computing, 1.0).bottleneck == "compute"
        loading = {"cpu_wait": cpu_wait_s, "data": 0.45 * scale, "forward": 0.55 * scale}
        assert diagnose(loading, 1.0).bottleneck == "data"
        assert ("CPU contention" in diagnose(loading, 1.0).text) == (cpu_wait_s >= 0.25)
    only_waiting = diagnose({"cpu_wait": 1.0}, 1.0)
    assert only_waiting.bottleneck == "balanced" and only_waiting.text.startswith("CPU contention")


def test_a_stream_written_before_cpu_wait_existed_still_reads():
    phases = dict.fromkeys(
        ["data", "h2d", "forward", "backward", "optimizer", "matchmaking", "allreduce"], 0.1
    ) | {"state_sync": 0.0, "idle": 0.0, "other": 0.3}
    line = {
        "t": 1.0, "peer": "p", "run": "r", "epoch": 0, "step": 1, "loss": None, "samples": 8,
        "samples_per_s": 8.0, "phases": phases, "net": {"sent": 0, "recv": 0},
        "cpu_percent": 100.0, "rss_bytes": 1,
    }  # fmt: skip
    assert validate_line(json.dumps(line)).phases["cpu_wait"] == 0.0
    with pytest.raises(ValueError, match="phases must be exactly"):
        validate_line(json.dumps(line | {"phases": phases | {"nap": 1.0}}))
