"""Partners meet where they last were: a group that stays together forms in a join and a wait;
and a leader invites the peers it sees.

Before, every round went through the DHT: announce (a store on the key's replicas), then read
the key, then join. At 10 rounds a second on two cores those requests were about 13 ms of every
round that the peers did not train (docs/BENCHMARKS.md, issue #25 item 2). Now a peer tries its
partners at the addresses of their last group first: it joins the best-ranked one above it and
invites those below it, while its announcement goes out for everyone else. And a leader's
invitation ("join me now") reaches a peer that announced before it, between that peer's reads:
before, no invitation was ever sent to a peer not invited yet (its last invitation's time,
-inf, plus an infinite interval was NaN, and no time is at or past NaN).
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from averaging.matchmaking.search import rank_of
from tests.averaging.conftest import exact_mean, fast_config

VALUES = [np.arange(6, dtype=np.float32), -2.0 * np.arange(6, dtype=np.float32)]
WEIGHTS = [3.0, 1.0]


def _count_reads(peer, prefix: str) -> list[str]:
    """The matchmaking keys ``peer`` read from the DHT from now on, as each read returns (its
    real node answers)."""
    reads: list[str] = []
    get_outcome = peer.averager._matchmaker._dht.get_outcome

    async def counting_get_outcome(key, *args, **kwargs):
        found = await get_outcome(key, *args, **kwargs)
        if str(key).startswith(prefix):
            reads.append(key)
        return found

    peer.averager._matchmaker._dht.get_outcome = counting_get_outcome
    return reads


async def _looking(peer) -> None:
    """Until ``peer`` leads a search (accepts followers)."""
    while True:
        search = peer.averager._matchmaker._search
        if search is not None and search.term is not None:
            return
        await asyncio.sleep(0.002)


def _by_rank(peers, epoch: int, settled: bool = True):
    key = peers[0].averager.matchmaking_key(epoch)
    return sorted(peers, key=lambda p: rank_of(key, p.peer_id, settled=settled))


async def _first_round(peers) -> None:
    pairs = zip(peers, WEIGHTS, strict=True)
    results = await asyncio.gather(
        *(p.averager.step(w, epoch=0, expected_peers=2) for p, w in pairs)
    )
    assert [r.status for r in results] == ["ok", "ok"], [r.reason for r in results]


def _assert_exact(peers, results, values) -> None:
    assert [r.status for r in results] == ["ok", "ok"], [r.reason for r in results]
    assert results[0].group_id == results[1].group_id
    expected = exact_mean(values, WEIGHTS)
    for peer in peers:
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-6)


async def _partners(make_swarm):
    """Two peers that averaged once (partners), their values set anew; (peers, leader,
    follower) by rank at epoch 1."""
    peers = await make_swarm([[v.copy()] for v in VALUES], config=fast_config())
    await _first_round(peers)
    for peer, v in zip(peers, VALUES, strict=True):
        peer.tensors[0][:] = v
    return (peers, *_by_rank(peers, epoch=1))


def _step(peer, peers, epoch: int):
    return peer.averager.step(WEIGHTS[peers.index(peer)], epoch=epoch, expected_peers=2)


def _in_order(peers, leader, leading, following) -> list:
    """The two results in the order of ``peers``."""
    return [leading, following] if peers[0] is leader else [following, leading]


@pytest.mark.timeout(60)
async def test_a_follower_joins_its_partner_without_reading_the_dht(make_swarm):
    peers, leader, follower = await _partners(make_swarm)
    reads = _count_reads(follower, "t.mm")

    leading = asyncio.create_task(_step(leader, peers, epoch=1))
    await _looking(leader)
    following = await _step(follower, peers, epoch=1)

    assert reads == []  # before: the follower read the key after its announcement, then joined
    _assert_exact(peers, _in_order(peers, leader, await leading, following), VALUES)


@pytest.mark.timeout(60)
async def test_a_follower_that_is_early_still_meets_its_partner(make_swarm):
    # the follower tries its partner before the partner looks: "not looking" must not exclude
    # it for the round; the partner's invite (or the DHT) brings the two together
    peers, leader, follower = await _partners(make_swarm)

    following = asyncio.create_task(_step(follower, peers, epoch=1))
    await _looking(follower)  # it leads until it finds its better-ranked partner
    await asyncio.sleep(0.2)
    leading = await _step(leader, peers, epoch=1)

    _assert_exact(peers, _in_order(peers, leader, leading, await following), VALUES)


@pytest.mark.timeout(60)
async def test_a_leader_invites_a_peer_that_announced_before_it(make_swarm):
    # newcomers (no partners): only the DHT brings them together. The worse-ranked one
    # announces and reads an empty key; its next read is a second away. The better-ranked one
    # comes, reads the key, sees it and invites it: it joins at once, without that next read.
    config = fast_config(matchmaking_poll_min_s=1.0, matchmaking_poll_max_s=1.0)
    peers = await make_swarm([[v.copy()] for v in VALUES], config=config)
    leader, follower = _by_rank(peers, epoch=0, settled=False)
    reads = _count_reads(follower, "t.mm")

    following = asyncio.create_task(_step(follower, peers, epoch=0))
    while True:  # its first read has returned (empty: the leader has not announced)
        if reads:
            break
        await asyncio.sleep(0.002)
    leading = await _step(leader, peers, epoch=0)
    following = await following

    assert len(reads) == 1, reads  # before: the invitation never came; it read again, joined
    _assert_exact(peers, _in_order(peers, leader, leading, following), VALUES)


async def test_a_search_whose_reads_all_fail_says_so_not_that_nobody_looked(make_swarm):
    # every read of the key runs out before a replica answers (a busy host): the peer cannot
    # tell whether anyone looked, and its reason must not say that nobody did
    peers = await make_swarm([[v.copy()] for v in VALUES], config=fast_config())
    lone = peers[0]
    dht = lone.averager._matchmaker._dht
    real_get_outcome = dht.get_outcome

    async def late_get_outcome(key, *args, **kwargs):
        return await real_get_outcome(key, *args, **{**kwargs, "timeout_s": 0.0})

    dht.get_outcome = late_get_outcome
    result = await lone.averager.step(epoch=7, timeout_s=1.0)
    assert result.status == "alone"
    failed = re.search(
        r"no other peer was looking for a group \((\d+) of (\d+) reads failed", result.reason
    )
    assert failed and failed[1] == failed[2] != "0", result.reason
