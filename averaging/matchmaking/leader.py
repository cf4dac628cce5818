"""The leader's side of matchmaking: seats followers and closes the group.

A leader keeps a seat for each of its partners (the members of its last rounds) that has not
joined yet: a stranger is refused once the seats left are its partners', so strangers cannot fill
a group before the partners arrive (a group of a leader and fresh ids, the partners left out).

``join`` is answered at once: a seat is reserved, or refused with why (full, following a better
leader, not looking, incompatible). ``wait`` takes the seat and is answered when the term ends:
with the group, with a redirect to the better leader this peer moved to, or with the reason the
group was given up. Only followers whose ``wait`` is in progress are put in the group, so a peer
that went elsewhere is never counted, and no peer ends up in two groups.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from averaging.bounds import is_number
from averaging.config import AveragerConfig
from averaging.errors import ProtocolViolation
from averaging.matchmaking.group import GroupInfo, GroupMember
from averaging.matchmaking.search import Candidate, Follower, Search, Term

logger = logging.getLogger(__name__)


class Leader:
    """Answers the ``join`` and ``wait`` requests of would-be followers.

    Args:
        config: group sizes and the reservation lapse (``request_timeout_s``).
        current: the search in progress, or None when this peer is not looking.
        partners: this peer's partners (their seats are kept).
        on_arrival: told how long after the search began each follower's ``wait`` came.
        num_streams: how many streams per pair a group this peer forms uses
            (:mod:`averaging.allreduce.streams`).
    """

    def __init__(
        self,
        config: AveragerConfig,
        current: Callable[[], Search | None],
        partners: Callable[[], frozenset[str]] = frozenset,
        on_arrival: Callable[[float], None] = lambda offset_s: None,
        num_streams: Callable[[], int] = lambda: 1,
    ):
        self._config = config
        self._current = current
        self._partners = partners
        self._on_arrival = on_arrival
        self._num_streams = num_streams

    async def on_join(self, ctx, request: Any) -> dict[str, Any]:
        search = self._current()
        if not isinstance(request, Mapping) or search is None or request.get("key") != search.key:
            return {"status": "not_looking"}
        if search.term is None:
            leader = search.following.to_wire() if search.following else None
            return {"status": "following", "leader": leader}
        term = search.term
        if term.outcome.done():
            return {"status": "full", "members": [search.me.peer_id]}
        try:
            member = GroupMember.from_wire(request.get("member"))
        except ProtocolViolation:
            return {"status": "malformed"}
        remaining_s = request.get("remaining_s")
        if member.peer_id != ctx.sender or not is_number(remaining_s):
            return {"status": "malformed"}
        # a seat is held no longer than this leader would wait itself, whatever is asked
        remaining_s = min(max(0.0, remaining_s), self._config.matchmaking_time_s)
        if request.get("numel") != search.numel:
            return {"status": "incompatible"}
        now = asyncio.get_running_loop().time()
        self._purge_reservations(term, now)
        if member.peer_id not in term.followers:
            # a partner's seat is kept for it: strangers (fresh ids among them) take the others,
            # so they cannot fill a group before the partners arrive and split the swarm
            partners = self._partners()
            reserved = 0 if member.peer_id in partners else len(partners - term.followers.keys())
            if 1 + len(term.followers) + reserved >= search.target_group_size:
                return {"status": "full", "members": [search.me.peer_id, *term.followers]}
        deadline = now + remaining_s
        follower = term.followers.get(member.peer_id)
        if follower is None:
            term.followers[member.peer_id] = Follower(member, deadline, now)
        else:  # the same follower again (its answer was lost): refresh the seat
            follower.member, follower.deadline, follower.reserved_at = member, deadline, now
        return {"status": "accepted"}

    def _purge_reservations(self, term: Term, now: float) -> None:
        lapse_s = self._config.request_timeout_s
        for peer_id, follower in list(term.followers.items()):
            if not follower.waiting and follower.reserved_at + lapse_s < now:
                del term.followers[peer_id]

    async def on_wait(self, ctx, request: Any) -> dict[str, Any]:
        search = self._current()
        term = search.term if search is not None else None
        if (
            not isinstance(request, Mapping)
            or term is None
            or request.get("key") != search.key
            or ctx.sender not in term.followers
        ):
            return {"status": "dropped"}
        follower = term.followers[ctx.sender]
        if request.get("leave") or term.outcome.done():
            if not term.outcome.done():
                del term.followers[ctx.sender]
            return _answer(term, ctx.sender)
        follower.waiting = True
        self._on_arrival(asyncio.get_running_loop().time() - search.started)
        if 1 + term.num_waiting >= search.target_group_size:
            self.finalize(search)
        timeout_s = follower.deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await asyncio.shield(term.outcome)
        except TimeoutError:
            # The follower gives up now: close the group with it if it is big enough.
            if not term.outcome.done():
                if 1 + term.num_waiting >= self._config.min_group_size:
                    self.finalize(search)
                else:
                    del term.followers[ctx.sender]
                    return {"status": "expired"}
        finally:
            if not term.outcome.done():  # it stopped waiting: it must not be put in the group
                follower.waiting = False
        return _answer(term, ctx.sender)

    def close(self, search: Search) -> GroupInfo | None:
        """At the leader's deadline: close the group if it is big enough, else disband."""
        term = search.term
        if term is None:
            return None
        if not term.outcome.done():
            if 1 + term.num_waiting >= self._config.min_group_size:
                self.finalize(search)
            else:
                term.outcome.set_result("too few peers joined in time")
        outcome = term.outcome.result()
        return outcome if isinstance(outcome, GroupInfo) else None

    def finalize(self, search: Search) -> None:
        """Form the group: this peer and every follower whose ``wait`` is in progress."""
        term = search.term
        members = [search.me] + [f.member for f in term.followers.values() if f.waiting]
        members.sort(key=lambda m: m.peer_id)
        group = GroupInfo(
            secrets.token_hex(16),
            tuple(members),
            search.compression,
            self._config.chunk_numel,
            self._config.aggregation,
            self._config.max_weight_ratio,
            self._num_streams(),
        )
        term.outcome.set_result(group)
        search.wakeup.set()
        logger.debug("formed group %s of %d under %s", group.group_id[:8], len(members), search.key)


def _answer(term: Term, peer_id: str) -> dict[str, Any]:
    if not term.outcome.done():
        return {"status": "left"}
    outcome = term.outcome.result()
    if isinstance(outcome, GroupInfo):
        if peer_id in outcome.peer_ids:
            return {"status": "group", "group": outcome.to_wire()}
        return {"status": "full", "members": list(outcome.peer_ids)}
    if isinstance(outcome, Candidate):
        return {"status": "redirect", "leader": outcome.to_wire()}
    return {"status": "disbanded", "reason": str(outcome)}
