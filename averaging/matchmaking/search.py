"""The state of one peer's search for a group, shared by its follower and leader sides."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from averaging.bounds import DEFAULT_MAX_WEIGHT_RATIO, check_address
from averaging.matchmaking.group import GroupInfo, GroupMember
from averaging.matchmaking.rows import SizePlan
from averaging.rules.compression import Compression
from dht.identity import is_peer_id
from dht.kademlia.validation import subkey_owner


class MatchmakingDHT(Protocol):
    """What matchmaking needs from the DHT (:class:`dht.kademlia.node.DHTNode` satisfies it)."""

    async def store(
        self,
        key: str,
        value: Any,
        expiration_time: float,
        subkey=None,
        *,
        replicas: int | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Whether a replica took the value; ``timeout_s`` bounds the store: at it, the
        replicas that accepted by then count."""

    async def get_outcome(
        self,
        key: str,
        *,
        latest: bool = False,
        replicas: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The value and whether the read failed (:class:`dht.kademlia.outcomes.GetOutcome`);
        ``replicas``: merge that many closest replicas (None: all); ``timeout_s`` bounds the
        lookup: at it, the value is what answered by then."""


@dataclass(frozen=True)
class Candidate:
    """A peer that announced it is looking for a group under the key."""

    peer_id: str
    address: str
    rank: bytes

    @property
    def settled(self) -> bool:
        return self.rank[:1] == SETTLED

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer_id, "addr": self.address, "settled": self.settled}


@dataclass(frozen=True)
class MatchResult:
    """A formed group, or None and why not (the caller then steps alone); ``stopped`` when the
    caller's ``stop_when`` ended the search before its time."""

    group: GroupInfo | None
    reason: str = ""
    stopped: bool = False

    @classmethod
    def of(cls, outcome: Any) -> MatchResult:
        """The result of a leader's term: its group, or why there is none."""
        return cls(outcome) if isinstance(outcome, GroupInfo) else cls(None, str(outcome))


@dataclass(frozen=True)
class SearchOptions:
    """What one search looks for beyond the config's defaults.

    Attributes:
        sizes: when a leader closes (None: at the target group size, no grace).
        top_rows: written into a group this peer forms (:attr:`GroupInfo.top_rows`).
        max_weight_ratio: the weight bound of the groups formed and accepted (None: the
            config's); the second level of a round bounds row weights more loosely.
        count: peers this peer's contribution stands for (:attr:`GroupMember.count`).
        with_partners: follow partners first (see :mod:`averaging.matchmaking.matchmaker`);
            off for the second level, where every delegate must meet every other.
        under_key: which partners can be under this search's key (None: all); with a sharded
            key, those of the same bucket (the others never come: no seat is kept for them).
        stop_when: asked between reads of the key while this peer neither follows a leader
            nor has followers; a reason ends the search at once ("alone", ``stopped``), None
            goes on. The caller's way to learn that nobody will come any more (e.g. the peers
            of this epoch moved on) without waiting out the matchmaking time. Runs on the
            event loop: it must be cheap and must not block.
    """

    sizes: SizePlan | None = None
    top_rows: int = 0
    max_weight_ratio: float | None = None
    count: int = 1
    with_partners: bool = True
    under_key: Callable[[str], bool] | None = None
    stop_when: Callable[[], str | None] | None = None


SETTLED, NEWCOMER = b"\x00", b"\x01"


def rank_of(key: str, peer_id: str, settled: bool = True) -> bytes:
    """The peer's place in the leader order of ``key`` (smaller leads): peers that have
    averaged before (``settled``, they say so in their announcement) before newcomers, then
    by ``sha256(key, peer id)``."""
    return (SETTLED if settled else NEWCOMER) + hashlib.sha256(
        key.encode() + bytes.fromhex(peer_id)
    ).digest()


CLIENT_RANK = b"\xff" * 34  # after every rank: a client-mode peer never leads
# A short row waits this many of its slowest reads of quiet, at least (Search.quiet_grace_s).
READS_PER_QUIET = 2


def parse_candidates(found: Any, key: str, own_peer_id: str) -> list[Candidate]:
    """The other peers announced in a DHT read of ``key`` (well-formed entries only)."""
    if found is None or not isinstance(found.value, Mapping):
        return []
    candidates = []
    for subkey, item in found.value.items():
        owner, value = subkey_owner(subkey), getattr(item, "value", None)
        if not (is_peer_id(owner) and isinstance(value, Mapping)):
            continue
        address, settled = value.get("addr"), value.get("settled") is True
        if owner != own_peer_id and check_address(address):
            candidates.append(Candidate(owner, address, rank_of(key, owner, settled)))
    return candidates


@dataclass(eq=False)
class Follower:
    """A peer that joined this leader: a reserved seat until its ``wait`` arrives."""

    member: GroupMember
    deadline: float  # loop time at which it gives up
    reserved_at: float
    waiting: bool = False


@dataclass(eq=False)
class Term:
    """One stretch of leading: the followers taken and how it ends."""

    outcome: asyncio.Future  # GroupInfo | Candidate (redirect) | str (disbanded, why)
    followers: dict[str, Follower] = field(default_factory=dict)

    @property
    def num_waiting(self) -> int:
        return sum(f.waiting for f in self.followers.values())


@dataclass(eq=False)
class Search:
    """One call of :meth:`averaging.matchmaking.matchmaker.Matchmaker.find_group`.

    ``term`` is set while this peer leads (accepts followers) and None while it follows
    ``following`` (or always, for a client-mode peer).
    """

    key: str
    me: GroupMember
    numel: int
    compression: Compression
    deadline: float
    rank: bytes
    target_group_size: int
    term: Term | None = None
    following: Candidate | None = None
    seen: set[str] = field(default_factory=set)
    excluded: set[str] = field(default_factory=set)
    skip_until: dict[str, float] = field(default_factory=dict)
    hints: dict[str, Candidate] = field(default_factory=dict)  # better leaders that invited us
    invited: dict[str, float] = field(default_factory=dict)  # peer: loop time of the invite
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task] = field(default_factory=set)
    strangers_after: float = 0.0  # loop time from which a peer with partners follows others
    started: float = 0.0  # loop time at which the search began
    sizes: SizePlan | None = None  # when a leader closes (None: at target_group_size)
    max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO  # of the groups formed and accepted
    partners: frozenset[str] = frozenset()  # followed first, seats kept for them
    top_rows: int = 0  # written into a group this peer forms
    vouched: set[str] = field(default_factory=set)  # strangers a trusted peer follows
    taken: set[str] = field(default_factory=set)  # in other groups (their leaders said so)
    last_arrival: float = 0.0  # loop time a follower last arrived or a peer was first seen
    num_reads: int = 0  # of the key's announcements
    num_reads_ended: int = 0  # of those, the ones that ended (failed ones included)
    reading: asyncio.Task | None = None  # the read in progress, if any
    num_failed_reads: int = 0  # of those, the ones that ran out or failed (nothing read)
    slowest_read_s: float = 0.0  # the longest of those reads took, in seconds
    stop_when: Callable[[], str | None] | None = None  # see SearchOptions

    def stop_reason(self) -> str | None:
        """Why the caller ends this search now, or None: asked only while this peer neither
        follows a leader nor has followers (a group in the making is never abandoned)."""
        if self.stop_when is None or self.following is not None:
            return None
        if self.term is not None and self.term.followers:
            return None
        return self.stop_when()

    def __post_init__(self) -> None:
        if self.sizes is None:
            self.sizes = SizePlan(self.target_group_size)
        self.target_group_size = self.sizes.target

    def resize(self) -> None:
        """Follow the peers seen under the key and those known to be in other groups
        (:meth:`averaging.matchmaking.rows.SizePlan.resized`)."""
        self.sizes = self.sizes.resized(1 + len(self.seen), len(self.taken & self.seen))
        self.target_group_size = self.sizes.target

    def see(self, peer_ids: Iterable[str], now: float) -> None:
        """``peer_ids`` were read under the key: the last arrival is now if any is new."""
        new = set(peer_ids) - self.seen - {self.me.peer_id}
        if new:
            self.seen.update(new)
            self.last_arrival = now

    def should_close(self, now: float, min_group_size: int) -> bool:
        """Whether this leader's group, as it stands, is complete: at its target, at the
        expected count, past the grace (and quiet) with at least the floor, or, a row search,
        past the grace and quiet for a grace with fewer."""
        if self.term is None or self.term.outcome.done():
            return False
        waiting = [f.member for f in self.term.followers.values() if f.waiting]
        size = 1 + len(waiting)
        sizes = self.sizes
        if size >= sizes.target:
            return True
        if sizes.expected_count and size >= min_group_size:
            # every peer counted is in; a count short of the truth (this peer's estimate of N
            # too low) must not close out delegates seen but not in yet, unless they went quiet
            counted = self.me.count + sum(m.count for m in waiting) >= sizes.expected_count
            if counted and (size >= sizes.floor or now >= self.last_arrival + sizes.quiet_s):
                return True
        if now < self.started + sizes.grace_s or size < min_group_size:
            return False
        if size >= sizes.floor:
            return now >= self.quiet_from() + sizes.quiet_s
        # a row below its floor that nobody joined or newly saw for a grace: those expected
        # found other rows (or are late; they come to the top round as rows of one). Waiting
        # out the matchmaking time for them made every round at 64 peers last its 12.8 s.
        # Quiet says nothing before a read of the key ended: partners that met through
        # invites closed rows of 2 and 3 at 256 peers while their first read was under way.
        return (
            bool(sizes.expected_in_key)
            and self.num_reads_ended > 0
            and now >= self.quiet_from() + self.quiet_grace_s()
        )

    def quiet_grace_s(self) -> float:
        """How long nobody new must have come before a short row gives up on those expected:
        the grace, and at least :data:`READS_PER_QUIET` of this search's slowest reads. Quiet
        for a grace says nothing when a read takes longer than the grace: at 256 light peers on
        2 cores reads took seconds, leaders closed rows of 2 and 3 after 1 s of "quiet", and
        76 rows sent their delegates to one top round too large to connect in time."""
        return max(self.sizes.grace_s, READS_PER_QUIET * self.slowest_read_s)

    def quiet_from(self) -> float:
        """The loop time from which a short close waits ``quiet_s``: the last arrival, or the
        end of the grace if later. Counted from the last arrival alone, a delegates' leader
        whose rows came early closed the instant its grace (the end of the row searches)
        ended, before the rows that close at that very deadline could come (their all-reduce
        and announcement take a while): a second top group, a second model."""
        return max(self.last_arrival, self.started + self.sizes.grace_s)

    def is_last(self, now: float) -> bool:
        """Past the grace, every other peer seen under the key is in another group, nobody new
        was seen for a grace, and nobody asked this leader for a seat: no row is left to form
        (the caller goes to the top round as a row of one rather than wait for the deadline)."""
        return (
            self.sizes.num_left == 1
            and bool(self.seen)
            and self.seen <= self.taken  # known, not merely unseen
            and now >= self.started + self.sizes.grace_s
            and now >= self.last_arrival + self.quiet_grace_s()  # and nobody new since
            and self.term is not None
            and not self.term.outcome.done()
            and not self.term.followers
        )

    @property
    def trusted(self) -> frozenset[str]:
        """The peers this one follows first: its partners, and the peers they follow."""
        return self.partners | self.vouched

    def vouch(self, peer_id: str, *, by: str) -> bool:
        """``by`` said it follows ``peer_id``: when ``by`` is trusted, so is ``peer_id`` (a
        partner vouches for its leader by following it). Whether ``peer_id`` is trusted now."""
        if by in self.trusted:
            self.vouched.add(peer_id)
        return peer_id in self.trusted

    @property
    def settled(self) -> bool:
        """Whether this peer ranks among the settled (it has partners)."""
        return self.rank[:1] == SETTLED

    def lead(self) -> None:
        """Start a new term (accept followers), unless following or in client mode."""
        if self.me.address is not None and self.term is None:
            self.term = Term(asyncio.get_running_loop().create_future())

    def parse_candidate(self, raw: Any) -> Candidate | None:
        """A better-ranked peer named in a message, or None (only ever wait for better ones:
        no cycles)."""
        if not isinstance(raw, Mapping):
            return None
        peer_id, address = raw.get("peer"), raw.get("addr")
        if not (is_peer_id(peer_id) and check_address(address)):
            return None
        candidate = Candidate(
            peer_id, address, rank_of(self.key, peer_id, raw.get("settled") is True)
        )
        if candidate.rank >= self.rank or peer_id in self.excluded:
            return None
        return candidate
