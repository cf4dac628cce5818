"""Requests a peer sends without reading the DHT first: invitations, and partners met where they
last were.

* An **invitation** (leader to a worse-ranked peer it sees under the key): "join me now", so
  that a peer that announced before its leader did joins it at once, not at its next read of the
  DHT. The invited peer's search takes it as a hint (:func:`until_invited` ends its wait on the
  DHT); a peer that follows someone answers with where it went ("following"), which vouches for
  that leader when the peer is trusted.
* **Partners where they last were** (:meth:`Invitations.meet_partners`): while its announcement
  goes out, a peer with partners joins the best-ranked one above it at the address of their last
  group, and invites the members of its last group ranked below it. A group whose members stay
  together then forms in a join and a wait, not after a DHT store and read (four to six requests
  more on the critical path: about 10 ms of each round at 0.1-s epochs on a loaded host). These
  go only to partners, at addresses their groups had: no record a stranger wrote chooses where.
  A partner that is not looking yet is neither excluded nor counted as invited: the DHT path
  tries it again once it shows.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from typing import Any

from averaging.matchmaking.follower import NOT_THERE, FollowerSide
from averaging.matchmaking.group import GroupInfo
from averaging.matchmaking.leader import Leader
from averaging.matchmaking.search import Candidate, Search, rank_of


class Invitations:
    """Sends and answers one peer's invitations; keeps its partners' last addresses.

    Args:
        side: the follower's side (requests, joins).
        leader: the leader's side (its answer when this peer is not looking).
        current: the search in progress, or None.
        peer_id: this peer's id.
        invite_name: the invitation handler's name.
    """

    def __init__(
        self,
        *,
        side: FollowerSide,
        leader: Leader,
        current: Callable[[], Search | None],
        peer_id: str,
        invite_name: str,
    ):
        self._side = side
        self._leader = leader
        self._current = current
        self._peer_id = peer_id
        self.invite_name = invite_name
        self._addresses: dict[str, str] = {}  # a partner's address in its last group
        self._last_group: frozenset[str] = frozenset()

    # ---- partners where they last were -------------------------------------------------------

    def note_group(self, group: GroupInfo) -> None:
        """This peer is in ``group``: where its members are, for the next search."""
        self._last_group = frozenset(group.peer_ids)
        for member in group.members:
            if member.peer_id != self._peer_id and member.address is not None:
                self._addresses[member.peer_id] = member.address

    def keep_only(self, partners: frozenset[str]) -> None:
        """Forget the addresses of peers that are no longer partners."""
        self._addresses = {p: a for p, a in self._addresses.items() if p in partners}

    async def meet_partners(self, search: Search) -> GroupInfo | None:
        """Invite the last group's members ranked below this peer and join the best-ranked
        partner above it (see the module docstring); the group, or None to look in the DHT."""
        known = [
            # a partner averaged with this peer, so it ranks among the settled
            Candidate(peer_id, address, rank_of(search.key, peer_id, settled=True))
            for peer_id, address in self._addresses.items()
            if peer_id in search.partners and peer_id not in search.excluded
        ]
        # invitations only to the last group's members: a burst bounded by a group's size
        worse = [c for c in known if c.rank > search.rank and c.peer_id in self._last_group]
        self.invite(search, worse, guessed=True)
        better = [c for c in known if c.rank < search.rank]
        if not better:
            return None
        return await self._side.follow(search, min(better, key=lambda c: c.rank), guessed=True)

    # ---- invitations -------------------------------------------------------------------------

    def invite(self, search: Search, candidates: list[Candidate], guessed: bool = False) -> None:
        """As a leader, tell the worse-ranked peers we see (``guessed``: partners, unseen) to
        join us now rather than at their next read of the DHT."""
        if search.term is None:
            return
        now = asyncio.get_running_loop().time()
        # a row search asks again, a grace later, those not known to be in a group: a peer
        # in one answers with its members, so the last peers of a key learn they are the last
        again_s = search.sizes.grace_s if search.sizes.expected_in_key else math.inf
        for candidate in candidates:
            invited_at = search.invited.get(candidate.peer_id)
            if (
                candidate.rank > search.rank
                # (a first invitation: -inf + inf is NaN, and no time is at or past NaN)
                and (invited_at is None or now >= invited_at + again_s)
                and candidate.peer_id not in search.term.followers
                and candidate.peer_id not in search.taken
            ):
                search.invited[candidate.peer_id] = now
                task = asyncio.create_task(self._send(search, candidate, guessed))
                search.tasks.add(task)
                task.add_done_callback(search.tasks.discard)

    async def _send(self, search: Search, candidate: Candidate, guessed: bool) -> None:
        request = {"key": search.key, "leader": search.me.address, "settled": search.settled}
        answer = await self._side.request(search, candidate, self.invite_name, request)
        status = answer.get("status")
        if guessed and status in NOT_THERE:
            search.invited.pop(candidate.peer_id, None)  # invited again once the DHT shows it
        elif status == "full":
            self._side.note_taken(search, answer)
        elif status == "following":  # a partner here follows a better leader
            leader = search.parse_candidate(answer.get("leader"))
            if leader is not None and search.vouch(leader.peer_id, by=candidate.peer_id):
                search.hints[leader.peer_id] = leader
                search.wakeup.set()

    async def on_invite(self, ctx, request: Any) -> dict[str, Any]:
        """A better-ranked leader tells us it is looking: try it at once."""
        search = self._current()
        if not isinstance(request, Mapping):
            return {"status": "malformed"}
        if search is None or request.get("key") != search.key:
            return self._leader.not_looking(request.get("key"))
        leader = search.parse_candidate(
            {"peer": ctx.sender, "addr": request.get("leader"), "settled": request.get("settled")}
        )
        if leader is not None:  # tried at the next look (after the wait, while following)
            search.hints[leader.peer_id] = leader
            search.wakeup.set()
        if search.following is not None:  # the inviter may follow where this peer went
            return {"status": "following", "leader": search.following.to_wire()}
        return {"status": "ignored"} if leader is None else {"status": "ok"}


async def until_invited(search: Search) -> None:
    """Until a better leader invited ``search``'s peer (``search.hints``)."""
    while not search.hints:
        search.wakeup.clear()  # a group formed meanwhile shows in the term's outcome
        await search.wakeup.wait()
