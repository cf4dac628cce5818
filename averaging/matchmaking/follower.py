"""The follower's side of matchmaking: join a leader, take the seat, follow its redirects.

A join is answered at once (a seat reserved, "following" a better leader, or refused); the seat
is then taken with a ``wait``, answered when the leader's term ends: the group (checked before
it is used), a redirect to the better leader it moved to, or why not. Whatever a trusted peer
says it follows becomes trusted too (:meth:`averaging.matchmaking.search.Search.vouch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from averaging.config import AveragerConfig
from averaging.errors import ProtocolViolation
from averaging.matchmaking.group import MAX_GROUP_SIZE, GroupInfo
from averaging.matchmaking.records import check_group, join_request
from averaging.matchmaking.search import Candidate, Search
from dht.errors import DHTError
from dht.identity import is_peer_id

logger = logging.getLogger(__name__)

_MAX_HOPS = 8  # redirects followed in one attempt; each goes to a better-ranked peer
# what a peer that is not looking (yet), or cannot be reached, answers (here, as a request's)
NOT_THERE = ("not_looking", "unreachable")


class FollowerSide:
    """Joins leaders for the searches of one peer's matchmaker.

    Args:
        transport: the network.
        peer_id: this peer's id.
        config: the request bound past a wait and the poll interval.
        deadlines: told when this follower's seat was taken; gives a request's bound.
        join_name, wait_name: the leader's handlers.
    """

    def __init__(
        self,
        *,
        transport,
        peer_id: str,
        config: AveragerConfig,
        deadlines,
        join_name: str,
        wait_name: str,
    ):
        self._transport = transport
        self._peer_id = peer_id
        self._config = config
        self._deadlines = deadlines
        self.join_name = join_name
        self.wait_name = wait_name

    async def follow(
        self, search: Search, leader: Candidate, *, guessed: bool = False
    ) -> GroupInfo | None:
        """Join ``leader`` (or where it redirects); the group, or None to keep looking.

        ``guessed``: a partner tried where it last was, before the DHT showed it looking; one
        that is not looking (yet) or out of reach is tried again once the DHT shows it."""
        target: Candidate | None = leader
        for _ in range(_MAX_HOPS):
            if target is None:
                return None
            request = join_request(search)
            answer = await self.request(search, target, self.join_name, request)
            status = answer.get("status")
            if status == "accepted":
                self._deadlines.observe_arrival(asyncio.get_running_loop().time() - search.started)
                return await self.take_seat(search, target)
            if status == "following":
                search.skip_until[target.peer_id] = (
                    asyncio.get_running_loop().time() + self._config.matchmaking_poll_min_s
                )
                asked = target.peer_id
                target = search.parse_candidate(answer.get("leader"))
                if target is not None:  # a trusted peer vouches for the leader it follows
                    search.vouch(target.peer_id, by=asked)
                continue
            if guessed and target is leader and status in NOT_THERE:
                return None
            search.excluded.add(target.peer_id)
            if status == "full":
                search.excluded.update(self.note_taken(search, answer))
            return None
        return None

    async def take_seat(self, search: Search, leader: Candidate) -> GroupInfo | None:
        if search.term is not None and search.term.outcome.done():
            # Our own group formed while the join was in flight: release the seat, keep ours.
            await self.request(search, leader, self.wait_name, {"key": search.key, "leave": True})
            return None
        if search.term is not None:
            search.term.outcome.set_result(leader)  # our followers go to the better leader
            search.term = None
        search.following = leader
        timeout_s = search.deadline - asyncio.get_running_loop().time()
        answer = await self.request(
            search,
            leader,
            self.wait_name,
            {"key": search.key},
            timeout_s=max(0.0, timeout_s) + self._config.request_timeout_s,
        )
        search.following = None
        status = answer.get("status")
        if status == "group":
            try:
                group = GroupInfo.from_wire(answer.get("group"))
                check_group(search, group, leader, self._config)
                return group
            except (ProtocolViolation, KeyError, ValueError, TypeError) as e:
                logger.warning("leader %s sent a bad group: %s", leader.peer_id[:8], e)
        elif status == "full":
            self.note_taken(search, answer)
        elif status == "redirect":
            redirect = search.parse_candidate(answer.get("leader"))
            if redirect is not None:  # a trusted leader vouches for the one it hands us to
                search.vouch(redirect.peer_id, by=leader.peer_id)
                search.excluded.add(leader.peer_id)
                search.lead()
                return await self.follow(search, redirect)
        search.excluded.add(leader.peer_id)
        search.lead()
        return None

    def note_taken(self, search: Search, answer: Mapping) -> set[str]:
        """The peers a "full" answer names as in that leader's group; when it formed, they
        count as taken in this search's sizes (only where they were also seen under the key)."""
        members = answer.get("members")
        if not isinstance(members, list):
            return set()
        named = {p for p in members[:MAX_GROUP_SIZE] if is_peer_id(p)} - {self._peer_id}
        if answer.get("formed") is True:
            search.taken.update(named)
            search.resize()
        return named

    async def request(
        self,
        search: Search,
        target: Candidate,
        name: str,
        payload: dict,
        timeout_s: float | None = None,
    ) -> dict:
        """Call ``name`` at ``target``: its answer, or ``{"status": "unreachable"}`` /
        ``"malformed"`` (bounded by the deadlines' request time and the search's deadline)."""
        if timeout_s is None:
            remaining_s = search.deadline - asyncio.get_running_loop().time()
            timeout_s = max(0.001, min(self._deadlines.request_s, remaining_s))
        try:
            answer = await self._transport.call(target.address, name, payload, timeout_s=timeout_s)
        except (DHTError, TimeoutError) as e:
            logger.debug("%s to %s failed: %s", name, target.peer_id[:8], e)
            return {"status": "unreachable"}
        if not isinstance(answer, dict):
            return {"status": "malformed"}
        logger.debug(
            "%s to %s: %s", name.rsplit(".", 1)[-1], target.peer_id[:8], answer.get("status")
        )
        return answer
