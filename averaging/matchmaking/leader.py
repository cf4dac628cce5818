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
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from averaging.bounds import is_number
from averaging.config import AveragerConfig
from averaging.errors import ProtocolViolation
from averaging.matchmaking.group import (
    GroupInfo,
    GroupMember,
    distinct_members,
    membership_refusal,
    num_reducers,
)
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
        serves_at: ``(address, peer id) -> bool``, whether that peer proves itself there
            (:func:`averaging.matchmaking.group.serves_at`): of two followers claiming one
            address, the one that proves it keeps the seat. None: the later one is refused.
    """

    def __init__(
        self,
        config: AveragerConfig,
        current: Callable[[], Search | None],
        partners: Callable[[], frozenset[str]] = frozenset,
        on_arrival: Callable[[float], None] = lambda offset_s: None,
        num_streams: Callable[[], int] = lambda: 1,
        serves_at: Callable[[str, str], Awaitable[bool]] | None = None,
    ):
        self._config = config
        self._current = current
        self._partners = partners
        self._on_arrival = on_arrival
        self._num_streams = num_streams
        self._serves_at = serves_at
        self.formed: tuple[str, tuple[str, ...]] = ("", ())  # the last group: key, members

    async def on_join(self, ctx, request: Any) -> dict[str, Any]:
        search = self._current()
        if not isinstance(request, Mapping):
            return {"status": "malformed"}
        if search is None or request.get("key") != search.key:
            return self.not_looking(request.get("key"))
        if search.term is None:
            leader = search.following.to_wire() if search.following else None
            return {"status": "following", "leader": leader}
        term = search.term
        if term.outcome.done():
            return _full(term, search)
        try:
            member = GroupMember.from_wire(request.get("member"))
        except ProtocolViolation:
            return {"status": "malformed"}
        remaining_s = request.get("remaining_s")
        if not is_number(remaining_s):
            return {"status": "malformed"}
        refusal = await self._check_member(search, term, member, ctx)
        if refusal is not None:  # a typed refusal of this member; the others go on
            logger.debug("refused %s as a follower: %s", ctx.sender[:8], refusal)
            return {"status": "malformed", "reason": refusal}
        if term.outcome.done():
            return _full(term, search)
        if request.get("numel") != search.numel:
            return {"status": "incompatible"}
        now = asyncio.get_running_loop().time()
        # a seat is held no longer than this leader waits itself, whatever is asked: its own
        # search's deadline, not the matchmaking time (a delegates' search runs past it, to the
        # end of the row searches; capped there, the first delegates' seats lapsed and the
        # leader closed with them before the last rows came: a second top group)
        remaining_s = min(max(0.0, remaining_s), max(0.0, search.deadline - now))
        self._purge_reservations(term, now)
        if member.peer_id not in term.followers:
            # a partner's seat is kept for it: strangers (fresh ids among them) take the others,
            # so they cannot fill a group before the partners arrive and split the swarm (but
            # not for a partner known to be in another group: it will not come)
            partners = self._partners() - search.taken
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

    def not_looking(self, key: Any) -> dict[str, Any]:
        """The answer to a request under ``key`` when this peer is not looking there: "full"
        with its group's members if it is in a group of that key (the asker counts them as
        taken, :mod:`averaging.matchmaking.rows`)."""
        formed_key, members = self.formed
        if members and key == formed_key:
            return formed_answer(members)
        return {"status": "not_looking"}

    async def _check_member(self, search: Search, term: Term, member: GroupMember, ctx):
        """Why ``member`` cannot be seated (None: it can): it must prove itself at its address
        (free with a current session, else one handshake). A follower seated under the same
        address before (it could not have proven it) loses its seat."""
        others = {p: f for p, f in term.followers.items() if p != member.peer_id}
        holder = next((p for p, f in others.items() if f.member.address == member.address), None)
        taken = [search.me.address] + [
            f.member.address for p, f in others.items() if p != holder or member.address is None
        ]
        refusal = membership_refusal(
            member, sender=ctx.sender, remote_host=ctx.remote_host, taken=taken
        )
        if refusal is not None or member.address is None:
            return refusal
        if self._serves_at is None:
            return None if holder is None else "another member of the group has this address"
        if not await self._serves_at(member.address, member.peer_id):
            return "the member does not prove itself at its address"
        if holder is not None:  # it claimed an address it does not serve at
            term.followers.pop(holder, None)
            logger.info("follower %s claimed %s's address: seat taken back", holder[:8],
                        ctx.sender[:8])  # fmt: skip
        return None

    def _purge_reservations(self, term: Term, now: float) -> None:
        lapse_s = self._config.request_timeout_s
        for peer_id, follower in list(term.followers.items()):
            if not follower.waiting and follower.reserved_at + lapse_s < now:
                del term.followers[peer_id]

    async def on_wait(self, ctx, request: Any) -> dict[str, Any]:
        search = self._current()
        term = search.term if search is not None else None
        if not isinstance(request, Mapping) or search is None or request.get("key") != search.key:
            return {"status": "dropped"}
        if term is None and search.following is not None:
            # this peer handed its term over between the follower's join and its wait: the
            # follower goes where the others went (answered "dropped", it led on its own)
            return {"status": "redirect", "leader": search.following.to_wire()}
        if term is None or ctx.sender not in term.followers:
            return {"status": "dropped"}
        follower = term.followers[ctx.sender]
        if request.get("leave") or term.outcome.done():
            if not term.outcome.done():
                del term.followers[ctx.sender]
            return _answer(term, ctx.sender)
        follower.waiting = True
        search.last_arrival = asyncio.get_running_loop().time()
        self._on_arrival(search.last_arrival - search.started)
        if search.should_close(asyncio.get_running_loop().time(), self._config.min_group_size):
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
        waiting = [f.member for f in term.followers.values() if f.waiting]
        # join refuses duplicates; this keeps a group formable whatever got past it (the
        # leader first, so nobody can take its place), and the followers left out are
        # answered "full" like any peer not in the group
        members, left_out = distinct_members([search.me, *waiting])
        if left_out:
            logger.warning("left %d followers out of the group: id or address taken", len(left_out))
        try:
            group = GroupInfo(
                secrets.token_hex(16),
                tuple(members),
                search.compression,
                self._config.chunk_numel,
                self._config.aggregation,
                search.max_weight_ratio,
                self._num_streams(),
                search.top_rows,
                num_reducers(members, self._config.target_group_size),
            )
        except ProtocolViolation as e:  # a bug here must not fail the followers' waits
            term.outcome.set_result(f"the group could not be formed: {e}")
            search.wakeup.set()
            return
        term.outcome.set_result(group)
        search.wakeup.set()
        logger.debug("formed group %s of %d under %s", group.group_id[:8], len(members), search.key)


def _full(term: Term, search: Search) -> dict[str, Any]:
    """The answer to a join after the term ended: the group's members when it formed (others
    then count them as taken in their sizes, :mod:`averaging.matchmaking.rows`)."""
    outcome = term.outcome.result()
    if isinstance(outcome, GroupInfo):
        return formed_answer(outcome.peer_ids)
    return {"status": "full", "members": [search.me.peer_id]}


def formed_answer(members: Iterable[str]) -> dict[str, Any]:
    """ "full": these peers are in a group that formed under the key (the asker counts them as
    taken; a "full" without ``formed`` names a group still forming, whose seats may yet free)."""
    return {"status": "full", "members": list(members), "formed": True}


def _answer(term: Term, peer_id: str) -> dict[str, Any]:
    if not term.outcome.done():
        return {"status": "left"}
    outcome = term.outcome.result()
    if isinstance(outcome, GroupInfo):
        if peer_id in outcome.peer_ids:
            return {"status": "group", "group": outcome.to_wire()}
        return formed_answer(outcome.peer_ids)
    if isinstance(outcome, Candidate):
        return {"status": "redirect", "leader": outcome.to_wire()}
    return {"status": "disbanded", "reason": str(outcome)}
