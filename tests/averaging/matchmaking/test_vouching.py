"""Rows that merge across past rows: a peer trusts the leader its partner follows, and a row
below its floor closes once nobody came for a grace.

Partners (the members of a peer's last rounds) are followed before strangers, against ground
ids. Before, a partner that followed a stranger was not followed there: peers of different past
rows each led a row of their own, and 64 peers formed 10 to 12 rows where 4 would hold them,
each waiting out the matchmaking time below its floor (issue 24: 12.8 s of every round).
"""

from __future__ import annotations

import asyncio

import numpy as np

from averaging.matchmaking.group import GroupMember
from averaging.matchmaking.rows import RoundPlan
from averaging.matchmaking.search import Follower, Search, SearchOptions, rank_of
from averaging.rules.compression import Compression
from tests.averaging.conftest import fast_config

KEY = "vouch.mm.1"


async def _three_by_rank(make_swarm, config):
    """Three peers sorted by their rank under KEY, best first."""
    peers = await make_swarm([[np.zeros(8, np.float32)] for _ in range(3)], config=config)
    return sorted(peers, key=lambda p: rank_of(KEY, p.peer_id))


def _partners(a, b) -> None:
    """``a`` and ``b`` averaged together (each one's partner)."""
    a.averager._matchmaker.note_round({a.peer_id, b.peer_id})
    b.averager._matchmaker.note_round({a.peer_id, b.peer_id})


async def _search_all(peers, options: SearchOptions, timeout_s: float):
    async def search(peer):
        return await peer.averager._matchmaker.find_group(
            KEY, weight=1.0, numel=8, compression=Compression.NONE, timeout_s=timeout_s,
            options=options,
        )  # fmt: skip

    return await asyncio.gather(*(search(p) for p in peers))


def _one_group_of_everyone(results, peers) -> None:
    groups = [r.group for r in results]
    assert all(g is not None for g in groups), [r.reason for r in results]
    assert {g.group_id for g in groups} == {groups[0].group_id}  # one group, one model
    assert set(groups[0].peer_ids) == {p.peer_id for p in peers}


async def test_a_peer_follows_its_partner_to_the_stranger_it_follows(make_swarm):
    # best C, then B, then A; A knows only B, B knows both. A asks B, which follows (or will
    # hand its followers to) C: A goes there too. Before: A led alone and C closed with B
    config = fast_config(matchmaking_time_s=4.0, matchmaking_poll_max_s=0.1)
    c, b, a = await _three_by_rank(make_swarm, config)
    _partners(a, b)
    _partners(b, c)

    results = await _search_all([a, b, c], SearchOptions(), timeout_s=4.0)

    _one_group_of_everyone(results, [a, b, c])


async def test_a_leader_follows_where_its_partner_went(make_swarm):
    # best C, then A, then B; A knows only B, B knows both. A has no better partner, so it
    # leads and invites B, worse-ranked; B follows C and says so: A follows C. Before: A led
    # alone (C, a stranger, ranks better but is not followed while a partner is looking)
    config = fast_config(matchmaking_time_s=8.0, matchmaking_poll_max_s=0.1)
    c, a, b = await _three_by_rank(make_swarm, config)
    _partners(a, b)
    _partners(b, c)
    # rows of three: a leader asks its worse-ranked peers again every grace
    options = SearchOptions(sizes=RoundPlan.of(3, 3, grace_s=2.0).row_sizes())

    results = await _search_all([a, b, c], options, timeout_s=8.0)

    _one_group_of_everyone(results, [a, b, c])


def _member(i: int) -> GroupMember:
    return GroupMember(f"{i:064x}", f"http://127.0.0.1:{9000 + i}", 1.0, 1.0)


async def test_a_row_below_its_floor_closes_once_nobody_came_for_a_grace():
    # 64 peers, rows of at most 16, two buckets: a row of 32 expected, floor 16. Five came;
    # the others found other rows. Before: it waited out the matchmaking time (100 s here)
    plan = RoundPlan.of(64, 16, grace_s=1.0)
    me = _member(0)
    search = Search("k.b2.0", me, 10, Compression.NONE, 100.0, rank_of("k.b2.0", me.peer_id),
                    16, sizes=plan.row_sizes())  # fmt: skip
    search.started = 0.0
    search.lead()
    search.see([_member(i).peer_id for i in range(1, 24)], now=0.2)  # a read that ended
    search.num_reads = search.num_reads_ended = 1
    search.resize()
    assert search.sizes.floor > 5
    for i in range(1, 5):
        search.term.followers[_member(i).peer_id] = Follower(_member(i), 100.0, 0.3, True)
    search.last_arrival = 1.5  # the last follower came after the grace

    assert not search.should_close(now=1.2, min_group_size=2)
    assert not search.should_close(now=2.4, min_group_size=2)  # quiet for less than a grace
    assert search.should_close(now=2.5, min_group_size=2)


async def test_the_delegates_search_still_waits_for_every_row():
    # the top round's plan has no expected peers per key: it never closes below its floor
    plan = RoundPlan.of(64, 16, grace_s=1.0)
    me = GroupMember(f"{0:064x}", "http://127.0.0.1:9000", 1.0, 1.0, count=16)
    search = Search("k.top", me, 10, Compression.NONE, 100.0, rank_of("k.top", me.peer_id),
                    2, sizes=plan.top_sizes(quiet_s=1.0))  # fmt: skip
    search.started = 0.0
    search.lead()
    search.see([_member(1).peer_id, _member(2).peer_id], now=0.2)
    search.resize()  # floor 3: every delegate seen
    search.term.followers[_member(1).peer_id] = Follower(_member(1), 100.0, 0.3, True)

    assert not search.should_close(now=50.0, min_group_size=2)
