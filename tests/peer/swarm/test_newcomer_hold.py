"""The lone peer's hold at its epoch boundary for a peer catching up (pure, fake clocks)."""

from __future__ import annotations

import pytest

from dht.errors import ConfigError
from peer.records.progress import PeerProgress
from peer.swarm.newcomer_hold import NewcomerHold, NewcomerHoldConfig
from peer.swarm.progress import GlobalProgress
from tests.peer.swarm.clocks import NOW, Clocks

pytestmark = pytest.mark.timeout(30)


def swarm(*others: tuple[str, int, float]) -> GlobalProgress:
    own = PeerProgress("me", 7, 300, 1000.0, NOW, None, False)
    peers = [own] + [PeerProgress(p, e, 0, 1000.0, t, None, False) for p, e, t in others]
    return GlobalProgress(7, 300, 256, 1000.0, 0.0, len(peers), 0, tuple(peers))


def make(wait_s: float = 10.0) -> tuple[NewcomerHold, Clocks]:
    clocks = Clocks()
    return NewcomerHold(NewcomerHoldConfig(wait_s=wait_s), **clocks.injected()), clocks


def test_holds_for_a_fresh_peer_behind_until_it_arrives():
    hold, clocks = make()
    assert hold.should_hold(swarm(("new", 0, NOW - 1.0)), epoch=7)
    clocks.advance(3.0)
    assert hold.should_hold(swarm(("new", 6, NOW + 2.0)), epoch=7)
    # it arrived at this epoch: nobody behind, no hold
    assert not hold.should_hold(swarm(("new", 7, NOW + 3.0)), epoch=7)
    assert hold.num_holds == 1


def test_gives_up_after_the_wait_and_never_waits_for_that_peer_again():
    hold, clocks = make(wait_s=10.0)
    assert hold.should_hold(swarm(("slow", 3, NOW)), epoch=7)
    clocks.advance(9.9)
    assert hold.should_hold(swarm(("slow", 3, NOW + 9.0)), epoch=7)
    clocks.advance(0.2)
    assert not hold.should_hold(swarm(("slow", 3, NOW + 10.0)), epoch=7)
    hold.reset()  # the epoch ended
    clocks.advance(1.0)
    assert not hold.should_hold(swarm(("slow", 4, NOW + 11.0)), epoch=8)
    # another newcomer still gets its wait
    assert hold.should_hold(swarm(("slow", 4, NOW + 11.0), ("other", 0, NOW + 11.0)), epoch=8)


def test_a_peer_given_up_on_that_averages_after_all_is_waited_for_again():
    """A newcomer slower to start than the wait, which then met this peer, fell behind again
    later: without a hold the lone peer stepped on through its download (issue 24)."""
    hold, clocks = make(wait_s=10.0)
    assert hold.should_hold(swarm(("slow", 3, NOW)), epoch=7)
    clocks.advance(10.1)
    assert not hold.should_hold(swarm(("slow", 3, NOW + 10.0)), epoch=7)
    hold.reset()
    hold.arrived(["slow"])  # it caught up and averaged with this peer
    clocks.advance(5.0)
    assert hold.should_hold(swarm(("slow", 11, NOW + 15.0)), epoch=12)
    assert hold.num_holds == 2


def test_ignores_stale_records_and_peers_ahead_and_can_be_off():
    hold, _ = make(wait_s=10.0)
    assert not hold.should_hold(swarm(("gone", 2, NOW - 10.5)), epoch=7)
    assert not hold.should_hold(swarm(("ahead", 9, NOW)), epoch=7)
    off, _ = make(wait_s=0.0)
    assert not off.should_hold(swarm(("new", 0, NOW)), epoch=7)
    with pytest.raises(ConfigError, match="newcomer wait"):
        NewcomerHoldConfig(wait_s=-1.0)


def test_holds_through_a_round_in_which_the_peer_behind_reports_nothing():
    """Issue 24: the peer behind reported just before a round of its own (a lagging record
    showed a peer at its epoch) and reports nothing until it ends, up to ``round_s`` later; the
    hold, begun after that report, must not run out with the round."""
    clocks = Clocks()
    hold = NewcomerHold(
        NewcomerHoldConfig(wait_s=10.0, round_s=10.0),
        monotonic=lambda: clocks.monotonic_s,
        dht_time=lambda: clocks.dht_s,
    )
    clocks.advance(1.0)  # this peer reaches its target a moment after the round began
    assert hold.should_hold(swarm(("new", 6, NOW)), epoch=7)
    clocks.advance(9.5)  # the round is about to end: the record is 10.5 s old
    assert hold.should_hold(swarm(("new", 6, NOW)), epoch=7)
    # then it downloads: the hold lasts a round and the wait, and no longer
    clocks.advance(8.0)
    assert hold.should_hold(swarm(("new", 6, NOW + 10.2)), epoch=7)
    clocks.advance(2.6)  # 20.1 s since the hold began
    assert not hold.should_hold(swarm(("new", 6, NOW + 10.2)), epoch=7)
    # a record older than a round and the wait is a peer gone
    fresh, _ = make(wait_s=10.0)
    assert not fresh.should_hold(swarm(("gone", 6, NOW - 10.5)), epoch=7)
