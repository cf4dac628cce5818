"""The state of one peer's search for a group, shared by its follower and leader sides."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from averaging.compression import Compression
from averaging.group import GroupInfo, GroupMember
from dht.identity import is_peer_id


class MatchmakingDHT(Protocol):
    """What matchmaking needs from the DHT (:class:`dht.node.DHTNode` satisfies it)."""

    async def store(self, key: str, value: Any, expiration_time: float, subkey=None) -> bool: ...

    async def get(self, key: str, latest: bool = False) -> Any: ...


@dataclass(frozen=True)
class Candidate:
    """A peer that announced it is looking for a group under the key."""

    peer_id: str
    address: str
    rank: bytes

    def to_wire(self) -> dict[str, str]:
        return {"peer": self.peer_id, "addr": self.address}


@dataclass(frozen=True)
class MatchResult:
    """A formed group, or None and why not (the caller then steps alone)."""

    group: GroupInfo | None
    reason: str = ""


def rank_of(key: str, peer_id: str) -> bytes:
    """The peer's place in the leader order of ``key`` (smaller leads)."""
    return hashlib.sha256(key.encode() + bytes.fromhex(peer_id)).digest()


CLIENT_RANK = b"\xff" * 33  # after every sha256: a client-mode peer never leads


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
    """One call of :meth:`averaging.matchmaking.Matchmaker.find_group`.

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
        if not (is_peer_id(peer_id) and isinstance(address, str) and address):
            return None
        candidate = Candidate(peer_id, address, rank_of(self.key, peer_id))
        if candidate.rank >= self.rank or peer_id in self.excluded:
            return None
        return candidate
