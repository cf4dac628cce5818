"""A group that must hold every peer (the delegates' search of a round's second level) waits
for the last ones: neither a seat's lapse nor the end of its grace closes it before they come.

Both faults split a loaded swarm into two top groups, two models (tests/averaging/
test_levels.py under CI's load; issue 24 at 64 peers): the first delegates joined the leader
early, their seats lapsed at the matchmaking time while the leader's own search ran on to the
end of the row searches, and the leader closed with them; or every delegate seen was in long
before the grace ended, so the leader closed the instant it ended, before the rows that close
at that very deadline came.
"""

from __future__ import annotations

import asyncio

import numpy as np

from averaging.matchmaking.group import GroupMember
from averaging.matchmaking.rows import SizePlan
from averaging.matchmaking.search import Follower, Search, SearchOptions, rank_of
from averaging.rules.compression import Compression
from tests.averaging.conftest import fast_config


def _everyone(num_peers: int, grace_s: float, quiet_s: float) -> SizePlan:
    """The delegates' sizes (:meth:`RoundPlan.top_sizes`) for ``num_peers`` of count 1."""
    return SizePlan(256, 2, grace_s, wait_for_seen=True, expected_count=num_peers, quiet_s=quiet_s)


async def test_a_seat_lasts_as_long_as_the_leaders_search_not_the_matchmaking_time(make_swarm):
    # the searches run 10 s, eight times the matchmaking time (as a delegates' search runs to
    # the end of the row searches); the third peer comes after the first seats would have
    # lapsed, and the group closes once it is in (its count completes the expected three)
    config = fast_config(matchmaking_time_s=1.2, request_timeout_s=1.0)
    peers = await make_swarm([[np.zeros(8, np.float32)] for _ in range(3)], config=config)
    options = SearchOptions(sizes=_everyone(3, grace_s=8.0, quiet_s=1.0), with_partners=False)

    async def search(index: int):
        await asyncio.sleep(2.5 if index == 2 else 0.0)
        return await peers[index].averager._matchmaker.find_group(
            "late.top",
            weight=1.0,
            numel=8,
            compression=Compression.NONE,
            timeout_s=10.0,
            options=options,
        )

    results = await asyncio.gather(*(search(i) for i in range(3)))

    groups = [r.group for r in results]
    assert all(g is not None for g in groups), [r.reason for r in results]
    assert {g.group_id for g in groups} == {groups[0].group_id}  # one group
    assert set(groups[0].peer_ids) == {p.peer_id for p in peers}


async def test_a_short_close_waits_the_quiet_time_after_the_grace_not_only_after_the_last_arrival():
    def member(i: int) -> GroupMember:
        return GroupMember(f"{i:064x}", f"http://127.0.0.1:{9000 + i}", 1.0, 1.0, count=3)

    me = member(0)
    sizes = _everyone(7, grace_s=10.0, quiet_s=1.0)  # 7 peers: rows of 3 + 3, one of 1 to come
    search = Search("k.top", me, 10, Compression.NONE, 100.0, rank_of("k.top", me.peer_id),
                    2, sizes=sizes)  # fmt: skip
    search.started = 0.0
    search.lead()
    search.see([member(1).peer_id], now=0.5)
    search.resize()
    search.term.followers[member(1).peer_id] = Follower(member(1), 100.0, 0.5, True)
    search.last_arrival = 0.6  # every delegate seen is in, long before the grace ends

    assert not search.should_close(now=10.0, min_group_size=2)  # the rows' deadline
    assert not search.should_close(now=10.9, min_group_size=2)  # the last row is still coming
    assert search.should_close(now=11.0, min_group_size=2)  # quiet since the grace ended


async def test_a_short_row_waits_for_quiet_of_two_slow_reads_not_only_a_grace():
    """Issue 24 at 256 light peers on 2 cores: a read took seconds, and leaders closed rows of
    2 and 3 after a 1-s grace of "quiet" in which nobody could have been seen."""

    def member(i: int) -> GroupMember:
        return GroupMember(f"{i:064x}", f"http://127.0.0.1:{9000 + i}", 1.0, 1.0)

    me = member(0)
    row = SizePlan(16, 16, 1.0, expected_in_key=16, group_size=16)  # a row of 16 expected
    search = Search("k", me, 10, Compression.NONE, 100.0, rank_of("k", me.peer_id), 16,
                    sizes=row)  # fmt: skip
    search.started = 0.0
    search.lead()
    search.see([member(1).peer_id], now=0.5)
    search.term.followers[member(1).peer_id] = Follower(member(1), 100.0, 0.5, True)
    search.last_arrival = 0.5
    search.num_reads = search.num_reads_ended = 1
    assert search.should_close(now=2.1, min_group_size=2)  # fast reads: a grace of quiet
    search.slowest_read_s = 3.0  # reads take seconds: a grace says nothing
    assert not search.should_close(now=2.1, min_group_size=2)
    assert not search.should_close(now=6.9, min_group_size=2)
    assert search.should_close(now=7.1, min_group_size=2)  # two slow reads of quiet


async def test_a_short_row_of_partners_waits_for_a_read_of_its_key_to_end():
    """Issue 24 at 256 light peers: partners met through invites in a second, and their
    leader closed a row of 2 after a grace of "quiet" while its first read of the key, which
    took seconds, was still under way: it knew nothing of the 30 peers of its bucket."""

    def member(i: int) -> GroupMember:
        return GroupMember(f"{i:064x}", f"http://127.0.0.1:{9000 + i}", 1.0, 1.0)

    me = member(0)
    row = SizePlan(16, 16, 1.0, expected_in_key=32, group_size=16, sharded=True)
    search = Search("k.b8.3", me, 10, Compression.NONE, 100.0, rank_of("k.b8.3", me.peer_id),
                    16, sizes=row)  # fmt: skip
    search.started = 0.0
    search.lead()
    search.resize()
    search.term.followers[member(1).peer_id] = Follower(member(1), 100.0, 0.2, True)
    search.last_arrival = 0.2
    search.num_reads = 1  # under way
    assert not search.should_close(now=30.0, min_group_size=2)
    search.num_reads_ended, search.slowest_read_s = 1, 8.0  # it ended: nobody else came
    search.see([member(1).peer_id], now=8.2)
    assert not search.should_close(now=20.0, min_group_size=2)  # two slow reads of quiet
    assert search.should_close(now=24.3, min_group_size=2)
