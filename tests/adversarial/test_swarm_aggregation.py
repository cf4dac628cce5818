"""Aggregation a member cannot poison: real averagers on loopback, and a member (or a leader) that
sends oversized weights, values or bandwidths, takes more than its share of the parts, or grinds
its id to lead every round.

Each test checks the honest peers' results against an independent reference (the weighted mean
in float64 of what the honest peers, and the attacker within its bounds, contributed).
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from averaging.bounds import FLOAT32_MAX, bounded_weights
from averaging.errors import ProtocolViolation
from averaging.matchmaking.group import GroupInfo, GroupMember
from averaging.matchmaking.matchmaker import Matchmaker
from averaging.matchmaking.search import rank_of
from averaging.rules.robust import Aggregation, num_trimmed
from dht.config import DHTConfig, get_dht_time
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.kademlia.validation import owner_subkey
from dht.net.config import TransportConfig
from tests.averaging.conftest import exact_mean, fast_config, make_group

pytestmark = pytest.mark.timeout(90)
SIZE = 20_000


def honest_vectors(num: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(num)]


async def test_values_that_overflow_once_weighted_get_their_sender_dropped(make_peers):
    """A member sends 1e38s with weight 5: finite on the wire, infinite once weighted (and a
    sum of finite 1e38s overflows too). Honest reducers drop it before anything is added."""
    vectors = honest_vectors(3)
    poison = np.full(SIZE, 1e38, np.float32)
    peers = await make_peers(
        [[v.copy()] for v in [*vectors, poison]], config=fast_config(), client_mode={3}
    )
    group = make_group(peers, [1.0, 2.0, 3.0, 5.0], chunk_numel=2048)
    results = await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
    expected = exact_mean(vectors, [1.0, 2.0, 3.0])
    for peer, result in zip(peers[:3], results[:3], strict=True):
        assert peers[3].peer_id in result.dropped_peers
        assert np.isfinite(peer.tensors[0]).all()
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)


async def test_a_huge_weight_is_bounded_relative_to_the_group(make_peers):
    vectors = honest_vectors(4)
    weights = [10.0, 12.0, 9.0, 2.0**53]  # the last member claims all the samples there are
    peers = await make_peers([[v.copy()] for v in vectors], config=fast_config())
    group = make_group(peers, weights, chunk_numel=2048)
    ratio = group.max_weight_ratio
    used = group.weights()
    assert used[peers[3].peer_id] == ratio * 10.0  # the lower median of the positive weights
    results = await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
    assert all(r.status == "ok" for r in results)
    expected = exact_mean(vectors, bounded_weights(weights, ratio))
    for peer in peers:
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
    # its share of the average is bounded: r / (r + n - 1) at most
    share = used[peers[3].peer_id] / sum(used.values())
    assert share <= ratio / (ratio + 3)


@pytest.mark.parametrize(
    "entry, why",
    [
        ({"w": 1e300}, "weight"),
        ({"w": float("inf")}, "weight"),
        ({"w": -1.0}, "weight"),
        ({"bw": 1e308}, "bandwidth"),
        ({"bw": float("nan")}, "bandwidth"),
        ({"addr": "ftp://1.2.3.4:5"}, "address"),
        ({"addr": "http://1.2.3.4"}, "address"),
    ],
)
def test_a_group_with_an_unbounded_entry_is_refused(entry, why):
    members = [
        GroupMember(f"{i:064x}", f"http://127.0.0.1:{5000 + i}", 1.0, 1.0).to_wire()
        for i in range(3)
    ]
    members[1] = {**members[1], **entry}
    wire = {"group": "ab", "members": members, "compression": "none", "chunk": 1024}
    wire |= {"agg": "mean", "wr": 8.0}
    with pytest.raises(ProtocolViolation, match=why):
        GroupInfo.from_wire(wire)


def test_no_member_gets_more_than_its_fair_share_of_the_parts():
    members = [
        GroupMember(f"{i:064x}", f"http://127.0.0.1:{5000 + i}", bw, 1.0)
        for i, bw in enumerate([1e12, 1.0, 1.0, 1.0])
    ]
    group = GroupInfo("g", tuple(members))
    sizes = [part.numel for part in group.parts(1_000_000)]
    assert sum(sizes) == 1_000_000
    assert sizes[0] <= 1_000_000 * 4 / (4 + 3) + 1  # four times the median at most


async def test_a_group_nobody_can_partition_fails_the_round_with_a_reason(make_peers):
    """A leader announcing every bandwidth as 0: the round fails with an AveragingError's
    reason (it was a ValueError from the partition), the tensors untouched."""
    vectors = honest_vectors(2)
    peers = await make_peers([[v.copy()] for v in vectors], config=fast_config())
    members = tuple(
        sorted(
            (GroupMember(p.peer_id, p.address, 0.0, 1.0) for p in peers),
            key=lambda m: m.peer_id,
        )
    )
    group = GroupInfo(secrets.token_hex(8), members)
    results = await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
    for peer, vector, result in zip(peers, vectors, results, strict=True):
        assert result.status == "failed" and "partition" in result.reason
        np.testing.assert_array_equal(peer.tensors[0], vector)


@pytest.mark.parametrize("aggregation", [Aggregation.TRIMMED_MEAN, Aggregation.CENTERED_CLIP])
async def test_robust_aggregation_bounds_a_poisoned_contribution(make_peers, aggregation):
    """Four honest gradients and one member's large (finite, in bounds) poison: the robust
    rules keep every coordinate near the honest mean; the plain mean would move it by 2e5."""
    vectors = honest_vectors(4, seed=5)
    poison = np.full(SIZE, 1e6, np.float32)
    peers = await make_peers([[v.copy()] for v in [*vectors, poison]], config=fast_config())
    group = make_group(peers, [1.0] * 5, chunk_numel=2048)
    group = GroupInfo(group.group_id, group.members, aggregation=aggregation)
    results = await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
    assert all(r.status == "ok" for r in results)
    honest = np.stack(vectors).astype(np.float64)
    if aggregation is Aggregation.TRIMMED_MEAN:
        ordered = np.sort(np.stack([*honest, poison.astype(np.float64)]), axis=0)
        b = num_trimmed(5)
        expected = ordered[b : 5 - b].mean(axis=0)
        for peer in peers[:4]:
            np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-5)
    honest_mean = honest.mean(axis=0)
    spread = np.median([np.linalg.norm(x - honest_mean) for x in honest])
    for peer in peers[:4]:
        values = peer.tensors[0].astype(np.float64)
        # no further from the honest mean than an honest gradient is (the plain mean: 2e5 * 141)
        assert np.linalg.norm(values - honest_mean) <= spread
        if aggregation is Aggregation.TRIMMED_MEAN:  # and inside the honest range, per value
            assert (values <= honest.max(axis=0) + 1e-5).all()
            assert (values >= honest.min(axis=0) - 1e-5).all()


async def test_a_follower_refuses_a_group_that_misrepresents_it(make_swarm):
    """A leader that lowers a follower's bandwidth to zero (to take its parts) or changes its
    weight: the follower refuses the group and steps alone, with its tensors untouched."""
    vectors = honest_vectors(2)
    peers = await make_swarm([[v.copy()] for v in vectors], config=fast_config(target_group_size=2))
    matchmakers = [p.averager._matchmaker for p in peers]
    original = type(matchmakers[0]._leader).finalize

    def greedy_finalize(self, search):
        original(self, search)
        group = search.term.outcome.result()
        forged = tuple(
            m
            if m.peer_id == search.me.peer_id
            else GroupMember(m.peer_id, m.address, 0.0, m.weight)
            for m in group.members
        )
        search.term.outcome = asyncio.get_running_loop().create_future()
        search.term.outcome.set_result(GroupInfo(group.group_id, forged))

    for matchmaker in matchmakers:
        matchmaker._leader.finalize = greedy_finalize.__get__(matchmaker._leader)
    results = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=0) for p in peers))
    follower = [i for i, r in enumerate(results) if r.status != "ok"]
    assert follower, [r.status for r in results]
    for index in follower:
        np.testing.assert_array_equal(peers[index].tensors[0], vectors[index])


async def test_partners_do_not_follow_a_ground_leader_that_never_forms_a_group(make_swarm):
    """A stranger grinds ids until one ranks first under the next round's key, announces it,
    accepts every join and never answers a wait (a black hole). Two peers that averaged together
    before follow each other, not it, and their round succeeds."""
    vectors = honest_vectors(2)
    config = fast_config(target_group_size=3, matchmaking_time_s=3.0)
    peers = await make_swarm([[v.copy()] for v in vectors], config=config)
    first = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=0) for p in peers))
    assert all(r.status == "ok" for r in first)
    key = peers[0].averager.matchmaking_key(1)
    best = min(rank_of(key, p.peer_id) for p in peers)
    identity = PeerIdentity.generate()
    while rank_of(key, identity.peer_id) >= best:  # a few tries: ids are free
        identity = PeerIdentity.generate()
    hole = HttpTransport(identity, TransportConfig())
    released = asyncio.Event()

    async def accept(ctx, request):
        return {"status": "accepted"}

    async def never(ctx, request):
        await released.wait()
        return {"status": "dropped"}

    hole.add_rpc_handler("averaging.t.join", accept)
    hole.add_rpc_handler("averaging.t.wait", never)
    node = DHTNode(
        transport=hole,
        identity=identity,
        config=DHTConfig(initial_peers=[peers[0].address], rpc_timeout_s=2.0),
    )
    async with hole:
        await node.start()
        try:
            value = {"addr": hole.address, "numel": SIZE, "settled": True}  # it lies
            expiration = get_dht_time() + 60
            assert await node.store(key, value, expiration, subkey=owner_subkey(identity.peer_id))
            second = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=1) for p in peers))
        finally:
            released.set()
            await node.close()
    assert all(r.status == "ok" for r in second), [r.reason for r in second]
    assert all(set(r.members) == {p.peer_id for p in peers} for r in second)
    assert isinstance(peers[0].averager._matchmaker, Matchmaker)


def test_bounds_keep_every_sum_finite():
    n = 16
    limit = FLOAT32_MAX / n
    total = np.float32(0)
    for _ in range(n):
        total = np.float32(total + np.float32(limit))
    assert np.isfinite(total)


async def test_a_newcomer_joins_the_settled_peers_whatever_its_rank(make_swarm):
    """Settled peers (they averaged before) rank before newcomers: a newcomer that would rank
    first under the key joins their group instead of leading a group nobody comes to."""
    vectors = honest_vectors(3)
    config = fast_config(target_group_size=3, matchmaking_time_s=3.0)
    peers = await make_swarm([[v.copy()] for v in vectors[:2]], config=config)
    first = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=0) for p in peers))
    assert all(r.status == "ok" for r in first)
    key = peers[0].averager.matchmaking_key(1)
    best = min(rank_of(key, p.peer_id) for p in peers)
    # A newcomer whose id alone would make it the leader. Only identities are drawn until one
    # does: a started peer per draw loaded the host for as many draws as the best rank needed.
    identity = PeerIdentity.generate()
    while rank_of(key, identity.peer_id) >= best:
        identity = PeerIdentity.generate()
    (newcomer,) = await make_swarm([[vectors[2].copy()]], config=config, identities=[identity])
    everyone = [*peers, newcomer]
    mirrored = [p.tensors[0].copy() for p in everyone]
    second = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=1) for p in everyone))
    assert all(r.status == "ok" and len(r.members) == 3 for r in second), [r.reason for r in second]
    expected = exact_mean(mirrored, [1.0] * 3)
    for peer in everyone:
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)


async def test_a_leader_keeps_its_partners_seats_from_strangers():
    """Target 3, one partner not in yet: one stranger gets the free seat, the next is refused
    (it would take the partner's), and the partner still gets in."""
    from types import SimpleNamespace

    from averaging.matchmaking.leader import Leader
    from averaging.matchmaking.search import Search
    from averaging.rules.compression import Compression

    partner, strangers = "aa" * 32, ["bb" * 32, "cc" * 32]
    me = GroupMember("ff" * 32, "http://127.0.0.1:9", 1.0, 1.0)
    search = Search("k", me, 10, Compression.NONE, 1e12, rank_of("k", me.peer_id), 3)
    search.lead()
    leader = Leader(fast_config(), lambda: search, lambda: frozenset({partner}))

    async def join(peer_id: str, port: int) -> str:
        member = GroupMember(peer_id, f"http://127.0.0.1:{port}", 1.0, 1.0)
        request = {"key": "k", "member": member.to_wire(), "numel": 10, "remaining_s": 1.0}
        answer = await leader.on_join(SimpleNamespace(sender=peer_id, remote_host=""), request)
        return answer["status"]

    assert await join(strangers[0], 5001) == "accepted"
    assert await join(strangers[1], 5002) == "full"
    assert await join(partner, 5003) == "accepted"
