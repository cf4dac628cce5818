"""When the collaborative optimizer recomputes the swarm estimate (pure, fake clock)."""

from __future__ import annotations

import pytest

from peer.swarm.estimate_gate import MAX_UNCHECKED_STEPS, EstimateGate

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 10.0

    def __call__(self) -> float:
        return self.now_s


def test_skips_until_the_end_of_the_epoch_is_two_steps_away():
    clock = FakeClock()
    gate = EstimateGate(monotonic=clock)
    assert gate.due(version=1, samples=0)  # the first step always checks
    gate.checked(eta_s=1.0, step_s=0.1)  # recheck at 10.8
    clock.now_s = 10.5
    assert not gate.due(version=1, samples=0)
    clock.now_s = 10.8
    assert gate.due(version=1, samples=0)
    gate.checked(eta_s=0.15, step_s=0.1)  # within two steps: every step checks
    assert gate.due(version=1, samples=0)


def test_new_records_an_epoch_change_or_too_many_steps_force_a_check():
    clock = FakeClock()
    gate = EstimateGate(monotonic=clock)
    assert gate.due(version=1, samples=0)
    gate.checked(eta_s=100.0, step_s=0.1)
    assert gate.due(version=2, samples=0)  # the tracker read new records
    gate.checked(eta_s=100.0, step_s=0.1)
    assert [gate.due(version=2, samples=0) for _ in range(MAX_UNCHECKED_STEPS)] == [
        False
    ] * MAX_UNCHECKED_STEPS
    assert gate.due(version=2, samples=0)  # no more than MAX_UNCHECKED_STEPS in a row go unchecked
    gate.checked(eta_s=100.0, step_s=0.1)
    gate.reset()
    assert gate.due(version=2, samples=0)


def test_unknown_rates_check_every_step():
    clock = FakeClock()
    gate = EstimateGate(monotonic=clock)
    assert gate.due(version=0, samples=0)
    gate.checked(eta_s=float("inf"), step_s=0.0)
    assert gate.due(version=0, samples=0)
    gate.checked(eta_s=float("inf"), step_s=0.1)  # a swarm with no rate yet: bounded by steps
    assert not gate.due(version=0, samples=0)


def test_a_lone_peer_checks_when_its_samples_reach_the_target_or_the_records_change():
    clock = FakeClock()
    gate = EstimateGate(monotonic=clock)
    assert gate.due(version=1, samples=32)
    gate.checked_alone(ready_at_samples=2048)
    clock.now_s = 1e6  # no rates involved: time alone never forces a check
    assert not any(gate.due(version=1, samples=s) for s in range(64, 2048, 32))
    assert gate.due(version=1, samples=2048)
    gate.checked_alone(ready_at_samples=2048)
    assert gate.due(version=2, samples=1024)  # new records: someone else may count now
    gate.checked(eta_s=100.0, step_s=0.1)  # not alone any more: back to the step bound
    assert [gate.due(version=2, samples=1056) for _ in range(MAX_UNCHECKED_STEPS + 1)][-1]
    gate.checked_alone(ready_at_samples=2048)
    gate.reset()  # a new epoch checks at once
    assert gate.due(version=2, samples=32)
