"""The hold of a peer ahead of most of the swarm, until they arrive (pure, fake clocks)."""

from __future__ import annotations

import pytest

from dht.errors import ConfigError
from peer.records.progress import PeerProgress
from peer.swarm.newcomer_hold import NewcomerHold, NewcomerHoldConfig
from peer.swarm.progress import GlobalProgress
from peer.swarm.readiness import Readiness
from peer.swarm.split_hold import MIN_BACKOFF_EPOCHS, SplitHold, SplitHoldConfig
from tests.peer.swarm.clocks import NOW, Clocks

pytestmark = pytest.mark.timeout(30)
TARGET = 8192
RATE = 1024.0  # the swarm's samples per second: an epoch takes 8 s


def swarm(
    epoch: int, *others: tuple[int, float], weights: tuple[float, ...] = ()
) -> GlobalProgress:
    """This peer at ``epoch`` past its target, and others as (epoch, record time)."""
    own = PeerProgress("me", epoch, TARGET, 100.0, NOW, None, False)
    peers = [own] + [
        PeerProgress(f"p{i}", e, 0, 100.0, t, None, False) for i, (e, t) in enumerate(others)
    ]
    return GlobalProgress(epoch, TARGET, TARGET, RATE, 0.0, len(peers), 0, tuple(peers), weights)


def make(wait_s: float = 60.0) -> tuple[SplitHold, Clocks]:
    clocks = Clocks()
    return SplitHold(SplitHoldConfig(wait_s=wait_s), **clocks.injected()), clocks


def split(epoch: int, behind: int, num_behind: int, num_with: int, at: float) -> GlobalProgress:
    """``num_behind`` peers at ``behind`` and ``num_with`` at ``epoch``, records made at ``at``."""
    return swarm(epoch, *[(behind, at)] * num_behind, *[(epoch, at)] * num_with)


def test_a_minority_two_epochs_ahead_holds_until_the_majority_arrives():
    hold, clocks = make()
    # 6 of the 31 others are with this peer, 25 are two epochs behind (records 1 s old)
    assert hold.should_hold(split(10, 8, 25, 6, NOW - 1.0), epoch=10)
    clocks.advance(8.0)
    assert hold.should_hold(split(10, 9, 25, 6, clocks.dht_s), epoch=10)
    clocks.advance(8.0)
    # the majority is at this epoch now: the hold ends (the replica check compares them here)
    assert not hold.should_hold(split(10, 10, 25, 6, clocks.dht_s), epoch=10)
    assert (hold.num_holds, hold.num_timeouts) == (1, 0)


def test_one_epoch_behind_or_a_minority_behind_is_no_split():
    hold, _ = make()
    assert not hold.should_hold(split(10, 9, 25, 6, NOW), epoch=10)  # a round that ended later
    assert not hold.should_hold(split(10, 5, 15, 16, NOW), epoch=10)  # not a strict majority
    assert not hold.should_hold(swarm(10, (5, NOW)), epoch=10)  # one peer: newcomer_hold's
    assert not hold.should_hold(swarm(10), epoch=10)
    assert hold.num_holds == 0


def test_records_that_lag_a_peer_at_the_swarms_pace_are_not_behind():
    hold, _ = make()
    # epochs of 8 s; records 17 s old at two epochs behind: those peers may well be here now
    assert not hold.should_hold(split(10, 8, 25, 6, NOW - 17.0), epoch=10)
    # sub-second epochs (the bench's): a record 2 s old shows its peer ten epochs back
    fast = GlobalProgress(
        40, TARGET, TARGET, 40 * RATE, 0.0, 3, 0, split(40, 30, 2, 0, NOW - 2.0).peers
    )
    assert not hold.should_hold(fast, epoch=40)
    # three epochs behind at 9 s: still more than one epoch behind at the swarm's pace
    assert hold.should_hold(split(10, 7, 25, 6, NOW - 9.0), epoch=10)


def test_weights_of_a_sampled_swarm_count():
    hold, _ = make()
    # two drawn records behind that stand for 20 peers each, four known ones here
    sampled = swarm(10, *[(8, NOW)] * 2, *[(10, NOW)] * 4, weights=(1, 20, 20, 1, 1, 1, 1))
    assert hold.should_hold(sampled, epoch=10)
    hold2, _ = make()
    sampled = swarm(10, *[(8, NOW)] * 2, *[(10, NOW)] * 4, weights=(1, 1, 1, 20, 20, 1, 1))
    assert not hold2.should_hold(sampled, epoch=10)


def test_a_hold_that_runs_out_is_not_started_again_for_a_while():
    hold, clocks = make(wait_s=60.0)
    assert hold.should_hold(split(10, 5, 3, 0, NOW), epoch=10)
    clocks.advance(59.0)
    assert hold.should_hold(split(10, 5, 3, 0, clocks.dht_s), epoch=10)
    clocks.advance(2.0)
    assert not hold.should_hold(split(10, 5, 3, 0, clocks.dht_s), epoch=10)
    assert hold.num_timeouts == 1
    for epoch in range(11, 10 + MIN_BACKOFF_EPOCHS):
        assert not hold.should_hold(split(epoch, 5, 3, 0, clocks.dht_s), epoch=epoch)
    epoch = 10 + MIN_BACKOFF_EPOCHS
    assert hold.should_hold(split(epoch, 5, 3, 0, clocks.dht_s), epoch=epoch)
    clocks.advance(61.0)
    assert not hold.should_hold(split(epoch, 5, 3, 0, clocks.dht_s), epoch=epoch)
    # twice as long after the second one
    later = epoch + 2 * MIN_BACKOFF_EPOCHS - 1
    assert not hold.should_hold(split(later, 5, 3, 0, clocks.dht_s), epoch=later)
    assert hold.should_hold(split(later + 1, 5, 3, 0, clocks.dht_s), epoch=later + 1)


def test_zero_wait_never_holds_and_a_negative_one_is_refused():
    hold, _ = make(wait_s=0.0)
    assert not hold.should_hold(split(10, 5, 25, 0, NOW), epoch=10)
    with pytest.raises(ConfigError, match="split wait"):
        SplitHoldConfig(wait_s=-1.0)


def test_readiness_holds_a_ready_peer_ahead_and_lets_it_go_when_they_arrive():
    hold, clocks = make()
    readiness = Readiness(overlaps=False, newcomer_hold=None, split_hold=hold)
    assert not readiness.ready(split(10, 8, 25, 6, NOW), 10, samples=TARGET)
    clocks.advance(16.0)
    assert readiness.ready(split(10, 10, 25, 6, clocks.dht_s), 10, samples=TARGET)


def test_a_lone_peer_ahead_of_several_holds_once_the_newcomer_hold_lets_go():
    clocks = Clocks()
    newcomer = NewcomerHold(NewcomerHoldConfig(wait_s=5.0), **clocks.injected())
    hold = SplitHold(SplitHoldConfig(wait_s=60.0), **clocks.injected())
    readiness = Readiness(overlaps=False, newcomer_hold=newcomer, split_hold=hold)
    assert not readiness.ready(split(10, 7, 3, 0, NOW), 10, samples=TARGET)
    assert newcomer.num_holds == 1 and hold.num_holds == 0
    clocks.advance(6.0)
    assert not readiness.ready(split(10, 7, 3, 0, clocks.dht_s), 10, samples=TARGET)
    assert hold.num_holds == 1


def test_the_pace_is_this_peers_measured_epochs_when_rounds_make_them_longer():
    hold, clocks = make()
    # by the rate alone an epoch takes 8 s, and records 12 s old two epochs back may be here
    assert not hold.should_hold(split(8, 6, 25, 6, NOW - 12.0), epoch=8)
    # this peer's own epochs took 20 s each (rounds on a busy host): they are still behind
    for epoch in (9, 10):
        clocks.advance(20.0)
        assert not hold.should_hold(split(epoch, epoch - 1, 25, 6, clocks.dht_s), epoch=epoch)
    clocks.advance(20.0)
    assert hold.should_hold(split(11, 9, 25, 6, clocks.dht_s - 12.0), epoch=11)
