"""The phase clock: exact attribution with a fake clock, and the real clock's sum."""

from __future__ import annotations

import threading
import time

import pytest

from peer.profiling.phases import PHASES, NullClock, PhaseClock

pytestmark = pytest.mark.timeout(30)


class FakeTime:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def expected(**seconds: float) -> dict[str, float]:
    return {name: seconds.get(name, 0.0) for name in PHASES}


def test_phases_are_the_contract():
    assert PHASES == (
        "data",
        "h2d",
        "forward",
        "backward",
        "optimizer",
        "matchmaking",
        "allreduce",
        "state_sync",
        "idle",
        "cpu_wait",
        "other",
    )


def test_time_inside_and_outside_phases():
    fake = FakeTime()
    clock = PhaseClock(now=fake)
    fake.advance(1.0)  # before any phase: other
    with clock.phase("data"):
        fake.advance(2.0)
    with clock.phase("forward"):
        fake.advance(3.0)
    fake.advance(0.5)
    with clock.phase("data"):
        fake.advance(0.25)
    snapshot = clock.snapshot()
    assert snapshot.seconds == expected(data=2.25, forward=3.0, other=1.5)
    assert snapshot.wall_s == 6.75
    assert sum(snapshot.seconds.values()) == snapshot.wall_s


def test_nesting_inner_takes_the_time_outer_resumes():
    fake = FakeTime()
    clock = PhaseClock(now=fake)
    with clock.phase("optimizer"):
        fake.advance(1.0)
        with clock.phase("matchmaking"):
            fake.advance(2.0)
            with clock.phase("allreduce"):
                fake.advance(4.0)
            assert clock.current == "matchmaking"
            fake.advance(8.0)
        fake.advance(16.0)
    assert clock.current == "other"
    assert clock.snapshot().seconds == expected(optimizer=17.0, matchmaking=10.0, allreduce=4.0)


def test_open_phase_counts_up_to_now_in_snapshot():
    fake = FakeTime()
    clock = PhaseClock(now=fake)
    with clock.phase("idle"):
        fake.advance(3.0)
        assert clock.snapshot().seconds["idle"] == 3.0
        fake.advance(1.0)
    assert clock.snapshot().seconds == expected(idle=4.0)


def test_reset_interval_gives_per_interval_numbers():
    fake = FakeTime()
    clock = PhaseClock(now=fake)
    with clock.phase("data"):
        fake.advance(2.0)
    first = clock.reset_interval()
    assert first.seconds == expected(data=2.0) and first.wall_s == 2.0
    with clock.phase("backward"):
        fake.advance(5.0)
        second = clock.reset_interval()  # splits the open phase at the interval boundary
        fake.advance(1.0)
    assert second.seconds == expected(backward=5.0) and second.wall_s == 5.0
    assert clock.interval().seconds == expected(backward=1.0)
    total = clock.snapshot()
    assert total.seconds == expected(data=2.0, backward=6.0) and total.wall_s == 8.0


def test_phase_ending_out_of_order_is_removed_where_it_is():
    # Thread A marks forward, thread B then marks allreduce, A's forward ends first.
    fake = FakeTime()
    clock = PhaseClock(now=fake)
    forward, allreduce = clock.phase("forward"), clock.phase("allreduce")
    forward.__enter__()
    fake.advance(1.0)
    allreduce.__enter__()
    fake.advance(2.0)
    forward.__exit__(None, None, None)
    assert clock.current == "allreduce"
    fake.advance(4.0)
    allreduce.__exit__(None, None, None)
    assert clock.current == "other"
    fake.advance(8.0)
    assert clock.snapshot().seconds == expected(forward=1.0, allreduce=6.0, other=8.0)


def test_listener_sees_contiguous_segments_and_sync_runs_at_each_boundary():
    fake = FakeTime()
    segments: list[tuple[str, float, float]] = []
    num_syncs = []
    clock = PhaseClock(
        now=fake,
        synchronize=lambda: num_syncs.append(1),
        listener=lambda *segment: segments.append(segment),
    )
    with clock.phase("forward"):
        fake.advance(1.0)
        with clock.phase("backward"):
            fake.advance(2.0)
    fake.advance(3.0)
    clock.snapshot()
    assert segments == [
        ("forward", 100.0, 101.0),
        ("backward", 101.0, 103.0),
        ("other", 103.0, 106.0),
    ]
    assert len(num_syncs) == 4  # two phases, two boundaries each


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase 'compute'"):
        PhaseClock().phase("compute")


def test_fractions():
    fake = FakeTime()
    clock = PhaseClock(now=fake)
    with clock.phase("data"):
        fake.advance(1.0)
    fake.advance(3.0)
    fractions = clock.snapshot().fractions()
    assert fractions["data"] == 0.25 and fractions["other"] == 0.75
    assert sum(fractions.values()) == 1.0


def test_real_clock_phases_sum_to_wall_time():
    clock = PhaseClock()
    start = time.perf_counter()
    for _ in range(20):
        with clock.phase("data"):
            time.sleep(0.002)
        with clock.phase("forward"):
            sum(range(2000))
            with clock.phase("allreduce"):
                time.sleep(0.001)
        time.sleep(0.001)
    snapshot = clock.snapshot()
    wall_s = time.perf_counter() - start
    assert abs(sum(snapshot.seconds.values()) - snapshot.wall_s) <= 1e-9 * snapshot.wall_s + 1e-12
    assert abs(snapshot.wall_s - wall_s) <= 0.01 * wall_s
    # The sleeps are lower bounds of what each phase was charged.
    assert snapshot.seconds["data"] >= 20 * 0.002
    assert snapshot.seconds["allreduce"] >= 20 * 0.001
    assert snapshot.seconds["other"] >= 20 * 0.001


def test_threads_marking_phases_keep_the_sum_exact():
    clock = PhaseClock()
    barrier = threading.Barrier(3)

    def worker(name: str) -> None:
        barrier.wait()
        for _ in range(2000):
            with clock.phase(name):
                pass

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("forward", "allreduce")]
    for thread in threads:
        thread.start()
    barrier.wait()
    for thread in threads:
        thread.join()
    assert clock.current == "other"
    snapshot = clock.snapshot()
    assert sum(snapshot.seconds.values()) == pytest.approx(snapshot.wall_s, rel=1e-9)


def test_a_sequence_charges_each_phase_with_one_boundary_between():
    fake = FakeTime()
    segments: list[tuple[str, float, float]] = []
    clock = PhaseClock(now=fake, listener=lambda *segment: segments.append(segment))
    with clock.sequence("data") as phase:
        fake.advance(1.0)
        phase.switch("forward")
        fake.advance(2.0)
        phase.switch("optimizer")
        fake.advance(0.125)
        with clock.phase("allreduce"):  # nested inside a sequence: takes the time
            fake.advance(4.0)
        fake.advance(0.5)
    fake.advance(0.25)
    snapshot = clock.snapshot()
    assert snapshot.seconds == expected(
        data=1.0, forward=2.0, optimizer=0.625, allreduce=4.0, other=0.25
    )
    assert [name for name, _, _ in segments] == [
        "data",
        "forward",
        "optimizer",
        "allreduce",
        "optimizer",
        "other",
    ]
    assert clock.current == "other"


def test_a_sequence_refuses_an_unknown_phase():
    clock = PhaseClock()
    with pytest.raises(ValueError, match="unknown phase 'compute'"):
        clock.sequence("compute")
    with clock.sequence("data") as phase, pytest.raises(ValueError, match="unknown phase"):
        phase.switch("compute")
    assert clock.current == "other"


def test_the_null_clock_measures_nothing():
    fake = FakeTime()
    clock = NullClock(now=fake)
    with clock.sequence("data") as phase:
        fake.advance(1.0)
        phase.switch("forward")
        with clock.phase("backward"):
            fake.advance(2.0)
    assert clock.snapshot().seconds == expected(other=3.0)
