"""Matchmaking: peers that want to average under the same key form groups through the DHT.

Every peer looking for a group announces itself in the DHT under the key, in a subkey only it can
write (:func:`dht.kademlia.validation.owner_subkey`: the record is signed). Peers are ranked by
``sha256(key, peer id)``, the same order for everyone and a different one every round. A peer
leads (accepts followers) until it sees a better-ranked peer that is looking; then it asks to join
that one, and if accepted hands its own followers over to it. So every wait points to a
better-ranked peer and no two peers can wait for each other.

The protocol has three requests, all answered at once except ``wait``:

* ``join`` (follower to leader): accepted, or refused with why (full, following someone else,
  not looking, incompatible). Accepting only reserves a seat.
* ``wait`` (follower to leader): takes the seat and waits until the group forms (answered with the
  group), the leader hands over to a better leader (a redirect), or gives up. Only followers whose
  ``wait`` is in progress are put in the group, so a peer never ends up in two groups.
* ``invite`` (leader to worse-ranked peers it sees in the DHT): "join me now", so that peers
  that announced before the leader did need not wait for their next read of the DHT.

**Leadership that fresh ids cannot grind** (ids are free: anyone can make one that ranks first).
Peers that averaged before announce ``settled`` and rank before newcomers. A peer follows only
the peers it *trusts* while any is looking, else (none seen for half its matchmaking time, or
none at all) whoever ranks best. It trusts its *partners* (members of its last
``num_partner_rounds`` rounds) and whoever a trusted peer says it follows (a join answered
"following", a redirect, or an invite answered "following": the partner vouches for its
leader). Without the vouching, partners from different past rows each led a row of their own,
and a swarm of 64 formed 10 to 12 rows where 4 would hold it. A ground id is trusted only once
some partner follows it, which a partner does only when it trusts it. Waits still point to
better-ranked peers: no cycles.
Every member checks the whole group (:func:`averaging.matchmaking.group.check_offered`); see
``docs/SECURITY.md``.

Peers announce before they first read, so of two peers that start together the later one always
sees the earlier one. Meanwhile a peer tries its partners where their last group had them
(:mod:`averaging.matchmaking.invites`): it invites those ranked below it and joins the best
ranked above it, so a group that stays together forms in a join and a wait, without the DHT.

The leader's side is :mod:`averaging.matchmaking.leader`, the follower's
:mod:`averaging.matchmaking.follower`; a leader closes its group as soon as it has
``target_group_size`` members, at its own deadline, or at a follower's deadline, whichever comes
first, if it has at least ``min_group_size``. Otherwise it disbands, and a
peer that found nobody gets an "alone" result.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from averaging.config import AveragerConfig, reducing_address
from averaging.matchmaking.follower import FollowerSide
from averaging.matchmaking.group import (
    GroupMember,
    serves_at,
)
from averaging.matchmaking.invites import Invitations, until_invited
from averaging.matchmaking.leader import Leader
from averaging.matchmaking.records import announce, read_candidates
from averaging.matchmaking.search import (
    CLIENT_RANK,
    Candidate,
    MatchmakingDHT,
    MatchResult,
    Search,
    SearchOptions,
    rank_of,
)
from averaging.rules.compression import Compression

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _partners_under_key(partners: frozenset[str], options: SearchOptions) -> frozenset[str]:
    """The partners this search may meet (see :class:`SearchOptions`)."""
    if not options.with_partners:
        return frozenset()
    if options.under_key is None:
        return partners
    return frozenset(p for p in partners if options.under_key(p))


class Matchmaker:
    """Finds a group for one averager.

    Args:
        transport: the network; the three request handlers are added here.
        dht: where peers announce themselves.
        peer_id: this peer's id.
        prefix: the averager's name (handlers are named after it).
        config: group sizes, bounds and poll intervals.
        deadlines: told how long after a search began a partner arrived (a follower's ``wait``
            at this leader, or this follower's seat taken); gives the bound of a request to a
            peer (DHT reads and stores stay bounded by ``request_timeout_s``).
        num_streams: streams per pair of a group this peer leads
        (:mod:`averaging.allreduce.streams`).
    """

    def __init__(
        self,
        *,
        transport,
        dht: MatchmakingDHT,
        peer_id: str,
        prefix: str,
        config,
        deadlines,
        num_streams: Callable[[], int] = lambda: 1,
    ):
        self._transport = transport
        self._dht = dht
        self._peer_id = peer_id
        self._config: AveragerConfig = config
        self._join_name = f"averaging.{prefix}.join"
        self._wait_name = f"averaging.{prefix}.wait"
        self._search: Search | None = None
        self._rounds: deque[frozenset[str]] = deque(maxlen=max(1, config.num_partner_rounds))
        self.partners: frozenset[str] = frozenset()
        self._deadlines = deadlines
        self._side = FollowerSide(
            transport=transport,
            peer_id=peer_id,
            config=config,
            deadlines=deadlines,
            join_name=self._join_name,
            wait_name=self._wait_name,
        )
        self._leader = Leader(
            config,
            lambda: self._search,
            lambda: self._search.partners if self._search is not None else frozenset(),
            deadlines.observe_arrival,
            num_streams,
            functools.partial(serves_at, transport, timeout_s=config.request_timeout_s),
        )
        self._invitations = Invitations(
            side=self._side,
            leader=self._leader,
            current=lambda: self._search,
            peer_id=peer_id,
            invite_name=f"averaging.{prefix}.invite",
        )
        transport.add_rpc_handler(self._join_name, self._leader.on_join)
        transport.add_rpc_handler(self._wait_name, self._leader.on_wait)
        transport.add_rpc_handler(self._invitations.invite_name, self._invitations.on_invite)

    def note_round(self, members: Iterable[str]) -> None:
        """``members`` averaged with this peer: partners for the next rounds."""
        if self._config.num_partner_rounds == 0:
            return
        self._rounds.append(frozenset(members) - {self._peer_id})
        self.partners = frozenset().union(*self._rounds)
        self._invitations.keep_only(self.partners)

    # ---- looking for a group -----------------------------------------------------------------

    async def find_group(
        self,
        key: str,
        *,
        weight: float,
        numel: int,
        compression: Compression,
        timeout_s: float,
        target_group_size: int | None = None,
        options: SearchOptions | None = None,
    ) -> MatchResult:
        """Look for a group under ``key`` for at most ``timeout_s`` seconds.

        ``target_group_size`` overrides the config's for this search (a caller that knows how
        many peers are ready lets a leader close as soon as they are all in); ``options.sizes``,
        when given, overrides both (balanced rows, :mod:`averaging.matchmaking.rows`).
        """
        if self._search is not None:
            raise RuntimeError("find_group is already running")
        search = self._new_search(
            key, weight, numel, compression, timeout_s, target_group_size, options
        )
        self._search = search
        try:
            announcing = None
            if search.me.address is not None:
                # Announce before the first read: of two peers that start together, the later
                # one then always sees the earlier one (and invites it or joins it).
                announcing = asyncio.create_task(announce(self._dht, search, self._config))
                search.tasks.add(announcing)  # cancelled once a group formed: nobody needs it
            group = await self._invitations.meet_partners(search)
            result = (
                MatchResult(group) if group is not None else await self._look(search, announcing)
            )
            if result.group is not None:  # later joins under the key learn who is taken
                self._deadlines.group_formed()
                self._leader.formed = (key, result.group.peer_ids)
                self._invitations.note_group(result.group)
            return result
        finally:
            self._search = None
            if search.term is not None and not search.term.outcome.done():
                search.term.outcome.set_result("the leader stopped looking")
            for task in search.tasks:
                task.cancel()
            if search.tasks:
                await asyncio.wait(search.tasks)

    def _new_search(
        self, key, weight, numel, compression, timeout_s, target_group_size, options
    ) -> Search:
        options = options or SearchOptions()
        loop = asyncio.get_running_loop()
        address = reducing_address(self._transport, self._config)
        me = GroupMember(self._peer_id, address, self._config.bandwidth, weight, options.count)
        settled = bool(self.partners)
        rank = rank_of(key, self._peer_id, settled) if address is not None else CLIENT_RANK
        target = target_group_size or self._config.target_group_size
        ratio = options.max_weight_ratio or self._config.max_weight_ratio
        search = Search(
            key,
            me,
            numel,
            compression,
            loop.time() + timeout_s,
            rank,
            target,
            sizes=options.sizes,
            max_weight_ratio=ratio,
            partners=_partners_under_key(self.partners, options),
            top_rows=options.top_rows,
            stop_when=options.stop_when,
        )
        search.started = search.last_arrival = loop.time()
        search.strangers_after = loop.time() + timeout_s / 2
        search.lead()
        return search

    async def _look(self, search: Search, announcing: asyncio.Task | None) -> MatchResult:
        loop = asyncio.get_running_loop()
        pause_s = self._config.matchmaking_poll_min_s
        candidates: list[Candidate] | None = None
        while True:
            if search.term is not None and search.term.outcome.done():
                return MatchResult.of(search.term.outcome.result())
            remaining_s = search.deadline - loop.time()
            if remaining_s <= 0:
                return self._close(search)
            stop_reason = search.stop_reason()
            if stop_reason is not None:
                return MatchResult(None, stop_reason, stopped=True)
            if candidates is None and search.hints:
                candidates = []  # a better leader invited us: try it before reading again
            if candidates is None:
                if announcing is not None and not announcing.done():
                    await self._unless_formed(search, asyncio.shield(announcing), hinted=True)
                    continue  # announced; or our group formed, or a better leader invited us
                if search.reading is None:
                    # an invite does not cancel the read: the next look takes its answer (at
                    # 256 busy peers a read took 5-12 s and partners' invites came every few,
                    # so reads cancelled by them never ended and rows closed knowing no one)
                    search.reading = asyncio.create_task(
                        read_candidates(self._dht, search, self._config, remaining_s)
                    )
                    search.tasks.add(search.reading)
                candidates = await self._unless_formed(
                    search, asyncio.shield(search.reading), hinted=True
                )
                if candidates is None:
                    continue  # our group formed meanwhile, or a better leader invited us
                search.tasks.discard(search.reading)
                search.reading = None
                search.see((c.peer_id for c in candidates), loop.time())
                search.resize()
            if search.should_close(loop.time(), self._config.min_group_size):
                self._leader.finalize(search)  # at its target, or past the grace with enough
                continue
            if search.is_last(loop.time()):
                # joins under the key count this peer as taken too (it goes to the top round)
                self._leader.formed = (search.key, (self._peer_id,))
                search.term.outcome.set_result("every other peer under the key is in a group")
                continue
            candidates.extend(search.hints.values())
            search.hints.clear()
            leader = self._best_leader(search, candidates)
            if leader is not None:
                group = await self._side.follow(search, leader)
                if group is not None:
                    return MatchResult(group)
                continue  # the next best from the same read: refusals say who is taken
            self._invitations.invite(search, candidates)
            await self._pause(search, min(pause_s, self._until_next_check(search)))
            pause_s = min(2 * pause_s, self._config.matchmaking_poll_max_s)
            candidates = None

    def _until_next_check(self, search: Search) -> float:
        """Seconds until the deadline, or until the grace (then the quiet) ends if that
        comes first (a row's quiet: the longer of the two, see :meth:`Search.should_close`)."""
        now = asyncio.get_running_loop().time()
        grace_end = search.started + search.sizes.grace_s
        quiet_end = search.quiet_from() + search.sizes.quiet_s  # never before the grace ends
        if search.sizes.expected_in_key:  # a row below its floor closes a grace after that
            quiet_end = max(quiet_end, search.quiet_from() + search.sizes.grace_s)
        wake_at = grace_end if now < grace_end else search.deadline
        if now < quiet_end:
            wake_at = min(wake_at, quiet_end)
        return max(0.0, min(wake_at, search.deadline) - now)

    async def _unless_formed(
        self, search: Search, coro: Awaitable[T], *, hinted: bool = False
    ) -> T | None:
        """``await coro``, unless our group forms first (then None: start the round now), or,
        with ``hinted``, a better leader invites us (then None: join it now, not after a DHT
        read)."""
        if search.term is None and not hinted:
            return await coro
        task = asyncio.ensure_future(coro)
        waits: set[asyncio.Future] = {task}
        if search.term is not None:
            waits.add(search.term.outcome)
        invited = asyncio.ensure_future(until_invited(search)) if hinted else None
        if invited is not None:
            waits.add(invited)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (task, invited):
                if waiter is not None and not waiter.done():
                    waiter.cancel()
                    await asyncio.wait({waiter})
        return None if task.cancelled() else task.result()

    async def _pause(self, search: Search, duration_s: float) -> None:
        """Sleep until the next read, or until a follower completes the group or a better
        leader invites us."""
        if not search.wakeup.is_set():
            try:
                async with asyncio.timeout(duration_s):
                    await search.wakeup.wait()
            except TimeoutError:
                pass
        search.wakeup.clear()

    def _best_leader(self, search: Search, candidates: list[Candidate]) -> Candidate | None:
        """The best-ranked peer above this one to follow: among the trusted (partners and
        those they follow) while any is looking (see the module docstring), else among all."""
        now = asyncio.get_running_loop().time()
        trusted = search.trusted
        if any(c.peer_id in trusted for c in candidates):
            candidates = [c for c in candidates if c.peer_id in trusted]
        elif trusted and now < search.strangers_after:
            return None  # partners may not have announced yet: lead for now
        eligible = [
            c
            for c in candidates
            if c.rank < search.rank
            and c.peer_id not in search.excluded
            and search.skip_until.get(c.peer_id, 0.0) <= now
        ]
        return min(eligible, key=lambda c: c.rank, default=None)

    def _close(self, search: Search) -> MatchResult:
        """At the deadline: the group if ours is big enough, else why we are alone."""
        group = self._leader.close(search)
        if group is not None:
            return MatchResult(group)
        if not search.seen:
            reason = "no other peer was looking for a group"
            if search.num_failed_reads:  # not "nobody": this peer could not tell
                reason += f" ({search.num_failed_reads} of {search.num_reads} reads failed)"
            return MatchResult(None, reason)
        self._deadlines.search_ran_out()  # others looked, and the window closed on them
        return MatchResult(
            None,
            f"saw {len(search.seen)} other peer(s) but no group of "
            f"{self._config.min_group_size} formed within the matchmaking time",
        )
