"""The matchmaking keys' layout: peers of a whole round lay their next round out alike, whatever
their own estimates of the swarm (averaging.rounds.LayoutMemory)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import numpy as np
import pytest

from averaging.matchmaking.rows import RoundPlan, bucket_key, key_buckets, layout_split_fraction
from averaging.result import RoundResult
from averaging.rounds import LayoutMemory, row_search
from tests.averaging.conftest import exact_mean, fast_config, sharded_round_config

pytestmark = pytest.mark.timeout(150)


def test_the_last_whole_round_lays_out_the_next_epoch_only():
    memory = LayoutMemory()
    assert memory.layout_peers(3, 40) is None  # no round yet: the estimate
    memory.note(3, RoundResult("ok", num_reached=64))
    assert memory.layout_peers(4, 40) == 64  # a count both sides of an edge agree on
    assert RoundPlan.of(40, 16, 1.0, memory.layout_peers(4, 40)).buckets == 2
    assert RoundPlan.of(40, 16, 1.0).buckets == 1  # what 40's own estimate would choose
    assert RoundPlan.of(40, 16, 1.0, 64).num_peers == 40  # the rows still follow the estimate
    assert memory.layout_peers(5, 40) is None  # an epoch skipped: not the same swarm's round
    assert memory.layout_peers(4, 200) is None  # under half the estimate: the swarm grew
    # far above it: an estimate that lags (the others' records an epoch old), kept
    assert memory.layout_peers(4, 20) == 64 and memory.layout_peers(4, 5) == 64
    memory.note(4, RoundResult("partial", num_reached=30))  # a part lost: the count reached
    assert memory.layout_peers(5, 40) == 30
    top_alone = {"row": "ok", "top": "alone"}  # the row's count is not the swarm's
    memory.note(5, RoundResult("partial", num_reached=16, levels=top_alone))
    assert memory.layout_peers(6, 16) is None
    memory.note(4, RoundResult("failed"))
    assert memory.layout_peers(5, 40) is None
    memory.note(5, RoundResult("ok", num_reached=1))
    assert memory.layout_peers(6, 1) is None
    memory.note(6, RoundResult("ok", num_reached=50))
    assert memory.layout_peers(None, 40) is None and memory.layout_peers(7, None) is None


def test_a_key_names_its_layout_and_split_searches_are_counted():
    peer = "cd" * 16
    assert [key_buckets(bucket_key("run.mm.4", peer, b)) for b in (1, 2, 8)] == [1, 2, 8]
    # two rounds: 3 of 4 searches on the common layout, then all 4
    assert layout_split_fraction([{1: 1, 2: 3}, {4: 4}]) == 0.125
    assert layout_split_fraction([]) is None


async def test_peers_whose_estimates_straddle_an_edge_meet_under_one_layout(make_swarm):
    """Eight peers, rows of 3: a whole round at epoch 0 reached all eight. At epoch 1 half of
    them estimate 8 (one key, by their own count) and half 12 (two buckets; no estimate is
    under the truth, which would close the top round early): every one lays its keys out for
    the eight its last round reached and searches the one key, and the round still ends with
    the exact weighted mean everywhere."""
    num_peers, group_size = 8, 3
    assert RoundPlan.of(8, group_size, 1.0).buckets == 1
    assert RoundPlan.of(12, group_size, 1.0).buckets == 2
    rng = np.random.default_rng(5)
    vectors = [rng.standard_normal(2_000).astype(np.float32) for _ in range(num_peers)]
    weights = [float(1 + i % 3) for i in range(num_peers)]
    config = sharded_round_config(group_size)
    peers = await make_swarm([[v.copy()] for v in vectors], config=config)
    estimates = {0: [num_peers] * num_peers, 1: [8, 12] * (num_peers // 2)}
    for epoch, expected in estimates.items():
        for peer, vector in zip(peers, vectors, strict=True):
            peer.tensors[0][:] = vector
        results = await asyncio.gather(
            *(
                p.averager.step(weight=w, epoch=epoch, expected_peers=n)
                for p, w, n in zip(peers, weights, expected, strict=True)
            )
        )
        assert [r.status for r in results] == ["ok"] * num_peers, [r.reason for r in results]
        assert [r.num_reached for r in results] == [num_peers] * num_peers
        base = peers[0].averager.matchmaking_key(epoch)
        assert {r.search_key for r in results} == {base}, [r.search_key for r in results]
        expected_mean = exact_mean(vectors, weights)
        for peer in peers:
            np.testing.assert_allclose(peer.tensors[0], expected_mean, rtol=1e-5, atol=1e-6)


def test_the_top_round_waits_for_the_last_whole_rounds_count_when_the_estimate_is_lower():
    assert RoundPlan.of(55, 16, 1.0, 64).top_sizes(1.0).expected_count == 64
    assert RoundPlan.of(64, 16, 1.0, 55).top_sizes(1.0).expected_count == 64  # the estimate
    assert RoundPlan.of(55, 16, 1.0).top_sizes(1.0).expected_count == 55  # no whole round yet


async def test_an_estimate_under_the_truth_does_not_split_the_round_after_a_whole_one(make_swarm):
    """Eight peers, rows of 3: a whole round at epoch 0 reached all eight. At epoch 1 every
    peer estimates 6, and two start late: the rows of the first six stand for the six counted,
    and a top round closed at that count left the late row to a top group of its own (a second
    model). Waiting for the eight the last whole round reached, every peer ends with the exact
    weighted mean.

    ``top_quiet_s`` is 4 s: under the full suite's load a late peer can find no row and run its
    row search to its end, 2 s after the early rows' (their top round's grace); it then comes to
    the top round alone, within the quiet time. Without the change the top round closes at the
    estimate's count, with every delegate it saw in, whatever the quiet time."""
    num_peers, late = 8, {2, 5}
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(2_000).astype(np.float32) for _ in range(num_peers)]
    weights = [float(1 + i % 3) for i in range(num_peers)]
    config = dataclasses.replace(sharded_round_config(3), top_quiet_s=4.0)
    peers = await make_swarm([[v.copy()] for v in vectors], config=config)

    async def step(index: int, epoch: int, expected: int):
        if epoch == 1 and index in late:
            await asyncio.sleep(2.0)
        peer = peers[index]
        return await peer.averager.step(weight=weights[index], epoch=epoch, expected_peers=expected)

    for epoch, expected in ((0, num_peers), (1, 6)):
        for peer, vector in zip(peers, vectors, strict=True):
            peer.tensors[0][:] = vector
        results = await asyncio.gather(*(step(i, epoch, expected) for i in range(num_peers)))
        outcomes = [(epoch, r.status, r.num_reached, r.levels, r.reason) for r in results]
        assert [r.status for r in results] == ["ok"] * num_peers, outcomes
        assert [r.num_reached for r in results] == [num_peers] * num_peers, outcomes
        expected_mean = exact_mean(vectors, weights)
        for peer in peers:
            np.testing.assert_allclose(peer.tensors[0], expected_mean, rtol=1e-5, atol=1e-6)


def test_a_swarm_whose_last_whole_round_took_two_levels_keeps_them():
    assert RoundPlan.of(16, 16, 1.0).single  # no whole round yet: the estimate decides
    plan = RoundPlan.of(16, 16, 1.0, 32)
    assert not plan.single and plan.num_rows == 2
    assert plan.row_sizes().target == 16  # the rows still follow the estimate
    assert RoundPlan.of(12, 16, 1.0, 16).single  # the last whole round fit in one group


async def rounds_after_a_whole_one(make_swarm, group_size: int, estimates: list[int], seed: int):
    """Eight peers average at epoch 0, each told of all eight, then at epoch 1 with
    ``estimates``; after each round every peer must hold the exact weighted mean. The results
    of epoch 1."""
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(2_000).astype(np.float32) for _ in estimates]
    weights = [float(1 + i % 3) for i in range(len(estimates))]
    config = sharded_round_config(group_size)
    peers = await make_swarm([[v.copy()] for v in vectors], config=config)
    for epoch, expected in ((0, [len(peers)] * len(peers)), (1, estimates)):
        for peer, vector in zip(peers, vectors, strict=True):
            peer.tensors[0][:] = vector
        results = await asyncio.gather(
            *(
                p.averager.step(weight=w, epoch=epoch, expected_peers=n)
                for p, w, n in zip(peers, weights, expected, strict=True)
            )
        )
        outcomes = [(epoch, r.status, len(r.members), r.levels, r.reason) for r in results]
        expected_mean = exact_mean(vectors, weights)
        for peer in peers:
            np.testing.assert_allclose(
                peer.tensors[0], expected_mean, rtol=1e-5, atol=1e-6, err_msg=str(outcomes)
            )
    return results


async def test_an_estimate_of_one_group_after_a_whole_round_of_two_keeps_one_model(make_swarm):
    """Eight peers, groups of at most 4: a whole round at epoch 0 reached all eight in two rows.
    At epoch 1 the peers estimate 2 to 4 (the records of the other rows are an epoch old at the
    boundary, as in a 32-peer ``peer join`` run): planned as one group, the halves closed groups
    of their own, and the swarm ended the round with two models or more. Planned for the eight
    the last whole round reached, the rows meet at the top and every peer holds the exact
    mean."""
    results = await rounds_after_a_whole_one(make_swarm, 4, [4, 2, 3, 4, 4, 2, 4, 3], seed=11)
    assert [(r.status, r.num_reached) for r in results] == [("ok", 8)] * 8


async def test_an_estimate_short_of_the_last_whole_group_waits_for_it(make_swarm):
    """Eight peers, groups of at most 8: a whole round at epoch 0 reached all eight in one
    group. At epoch 1 they estimate 3 to 5: planned from the estimate alone, leaders closed
    groups of 3 to 5 (two models or more); waiting for the eight the last whole round reached,
    one group holds them all."""
    results = await rounds_after_a_whole_one(make_swarm, 8, [4, 3, 5, 4, 4, 3, 4, 5], seed=13)
    assert [len(r.members) for r in results] == [8] * 8


def test_a_peer_meets_the_same_bucket_every_round_under_a_new_key():
    """Buckets drawn per epoch split every row of the last round over the next round's
    buckets; partners then led rows of their own in each (64 light peers: 7 to 12 rows per
    round where 4 or 5 hold them). Drawn from the run's key, the rows a swarm formed meet
    again, under keys that still change every round."""
    config = fast_config()
    peers = [hashlib.sha256(bytes([i])).hexdigest() for i in range(64)]
    plan = RoundPlan.of(256, 16, 1.0)
    seed = "run.mm"

    def bucket(peer: str, epoch: int) -> str:
        key, options = row_search(config, peer, f"run.mm.{epoch}", plan, seed)
        assert key.startswith(f"run.mm.{epoch}.b8.")
        assert options.under_key(peer)  # its partners of the same bucket keep their seats
        return key.rsplit(".", 1)[1]

    for peer in peers:
        assert len({bucket(peer, epoch) for epoch in range(5)}) == 1
    assert len({bucket(peer, 0) for peer in peers}) == 8  # every bucket is used
    # when the layout doubles, a bucket splits in two: half of a row still meets
    for peer in peers:
        of_16 = int(bucket_key("run.mm.7", peer, 16, seed).rsplit(".", 1)[1])
        assert str(of_16 % 8) == bucket(peer, 7)
