"""Deadlines that adapt (:mod:`averaging.deadlines`): the estimator on its own, and real
averagers on loopback whose waits for a vanished peer come from what they measured."""

from __future__ import annotations

import pytest

from averaging.config import AveragerConfig
from averaging.deadlines import MIN_SAMPLES, Deadlines, SampleWindow
from averaging.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def test_quantile_is_nearest_rank_over_the_recent_window():
    window = SampleWindow(maxlen=10)
    assert window.quantile(0.9) is None
    for value in [100.0] + [float(v) for v in range(1, 11)]:  # 100 falls out of the window
        window.add(value)
    window.add(float("nan"))  # ignored
    assert len(window) == 10
    assert window.quantile(0.9) == 9.0 and window.quantile(0.5) == 5.0


def test_cold_start_uses_the_fields_then_measurements_within_bounds():
    config = AveragerConfig(min_deadline_s=0.05, max_deadline_s=40.0)
    deadlines = Deadlines(config)
    assert deadlines.snapshot() == {
        "matchmaking_s": 5.0,
        "sender_s": 5.0,
        "reducer_s": 10.0,
        "group_wait_s": 5.0,
        "allreduce_s": 60.0,
    }
    for _ in range(MIN_SAMPLES):
        deadlines.observe_sender_wait(0.002)
        deadlines.observe_reducer_wait(0.003)
        deadlines.observe_arrival(0.01)
    waits = deadlines.snapshot()
    assert waits["sender_s"] == pytest.approx(0.05)  # 4 x 2 ms is below the floor
    assert waits["reducer_s"] == pytest.approx(0.1)  # at least twice the sender wait
    assert waits["group_wait_s"] == waits["sender_s"]
    assert waits["matchmaking_s"] == pytest.approx(0.05)
    for _ in range(NUM := 20):
        deadlines.observe_sender_wait(7.0)  # a thin link: 7 s per chunk
        deadlines.observe_reducer_wait(14.0)
    assert NUM > MIN_SAMPLES
    waits = deadlines.snapshot()
    assert waits["sender_s"] == pytest.approx(20.0)  # 4 x 7 s, capped at half the ceiling
    assert waits["reducer_s"] == pytest.approx(40.0)  # 4 x 14 s, capped at the ceiling


def test_rtt_sets_a_floor_and_the_matchmaking_field_a_ceiling():
    config = AveragerConfig(min_deadline_s=0.01, matchmaking_time_s=2.0)
    deadlines = Deadlines(config, rtt_s=lambda: 0.15)
    for _ in range(MIN_SAMPLES):
        deadlines.observe_sender_wait(0.001)
        deadlines.observe_arrival(0.001)
    assert deadlines.sender_s == pytest.approx(4 * 2 * 0.15)  # two RTTs, times the safety
    assert deadlines.matchmaking_s == pytest.approx(2.0)  # 4 x 4 RTTs = 2.4 s, over the bound


def test_a_wait_that_ran_out_doubles_until_a_round_measures_without_one():
    deadlines = Deadlines(AveragerConfig())
    deadlines.ran_out("sender")
    deadlines.end_round()
    assert deadlines.sender_s == 10.0 and deadlines.reducer_s == 20.0
    deadlines.ran_out("sender")
    deadlines.end_round()
    assert deadlines.sender_s == 20.0
    deadlines.end_round()  # nothing measured: the back-off stays
    assert deadlines.sender_s == 20.0
    deadlines.observe_sender_wait(0.5)
    deadlines.end_round()
    assert deadlines.sender_s == 5.0  # back to the (cold) estimate


def test_fixed_deadlines_are_the_fields():
    config = AveragerConfig(adaptive_deadlines=False, sender_timeout_s=3.0)
    deadlines = Deadlines(config, rtt_s=lambda: 1.0)
    for _ in range(10):
        deadlines.observe_sender_wait(0.001)
    deadlines.ran_out("sender")
    deadlines.end_round()
    assert deadlines.sender_s == 3.0 and deadlines.reducer_s == 10.0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"deadline_safety": 0.5}, "deadline_safety"),
        ({"min_deadline_s": 0.0}, "min_deadline_s"),
        ({"max_deadline_s": float("inf")}, "max_deadline_s"),
        ({"min_deadline_s": 2.0, "max_deadline_s": 3.0}, "max_deadline_s"),
        ({"adaptive_deadlines": "yes"}, "adaptive_deadlines"),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        AveragerConfig(**changes)
