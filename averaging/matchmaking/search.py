"""The state of one peer's search for a group, shared by its follower and leader sides."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
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

    async def store(self, key: str, value: Any, expiration_time: float, subkey=None) -> bool: ...

    async def get(self, key: str, latest: bool = False) -> Any: ...


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
    """A formed group, or None and why not (the caller then steps alone)."""

    group: GroupInfo | None
    reason: str = ""

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
    """

    sizes: SizePlan | None = None
    top_rows: int = 0
    max_weight_ratio: float | None = None
    count: int = 1
    with_partners: bool = True


SETTLED, NEWCOMER = b"\x00", b"\x01"


def rank_of(key: str, peer_id: str, settled: bool = True) -> bytes:
    """The peer's place in the leader order of ``key`` (smaller leads): peers that have
    averaged before (``settled``, they say so in their announcement) before newcomers, then
    by ``sha256(key, peer id)``."""
    return (SETTLED if settled else NEWCOMER) + hashlib.sha256(
        key.encode() + bytes.fromhex(peer_id)
    ).digest()


CLIENT_RANK = b"\xff" * 34  # after every rank: a client-mode peer never leads


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
    invited: set[str] = field(default_factory=set)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task] = field(default_factory=set)
    strangers_after: float = 0.0  # loop time from which a peer with partners follows others
    started: float = 0.0  # loop time at which the search began
    sizes: SizePlan | None = None  # when a leader closes (None: at target_group_size)
    max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO  # of the groups formed and accepted
    partners: frozenset[str] = frozenset()  # followed first, seats kept for them
    top_rows: int = 0  # written into a group this peer forms

    def __post_init__(self) -> None:
        if self.sizes is None:
            self.sizes = SizePlan(self.target_group_size)
        self.target_group_size = self.sizes.target

    def resize(self, num_seen: int) -> None:
        """``num_seen`` peers (this one included) were seen under the key: follow them
        (:meth:`averaging.matchmaking.rows.SizePlan.resized`)."""
        self.sizes = self.sizes.resized(num_seen)
        self.target_group_size = self.sizes.target

    def should_close(self, now: float, min_group_size: int) -> bool:
        """Whether this leader's group, as it stands, is complete: at its target, or past the
        grace with at least the floor."""
        if self.term is None or self.term.outcome.done():
            return False
        size = 1 + self.term.num_waiting
        if size >= self.sizes.target:
            return True
        grace_over = now >= self.started + self.sizes.grace_s
        return grace_over and size >= max(self.sizes.floor, min_group_size)

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
