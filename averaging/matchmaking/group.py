"""A formed group: who averages together this round, and how that travels on the wire.

Wire format (a msgpack map; the leader sends it, every member checks it whole):
``group`` (hex id), ``members`` (a list of ``{peer, addr, bw, w}``, sorted by peer id, no peer
or address twice), ``compression``, ``chunk`` (values per chunk), ``agg`` (the aggregation
rule, :mod:`averaging.rules.robust`), ``wr`` (the weight ratio of :func:`averaging.bounds.
bounded_weights`), ``streams`` (streams per sender and reducer, 1 when absent; see
:mod:`averaging.allreduce.streams`) and ``top`` (rows the round's second level expects, 0 or
absent when this group is the whole round; see :mod:`averaging.levels`). A member's ``n``
(absent: 1) is how many peers its contribution stands for (a row's delegate at the second
level). Entries are bounded (:mod:`averaging.bounds`), and the parts and weights every member
uses are the bounded ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from averaging.bounds import (
    DEFAULT_CHUNK_NUMEL,
    DEFAULT_MAX_WEIGHT_RATIO,
    MAX_CHUNK_NUMEL,
    MAX_STREAMS_PER_PAIR,
    MAX_WEIGHT_RATIO,
    bounded_weights,
    check_address,
    fair_bandwidths,
    is_number,
    valid_bandwidth,
    valid_weight,
)
from averaging.errors import ProtocolViolation
from averaging.matchmaking.partition import Part, make_parts, split_streams
from averaging.rules.compression import UINT8_BLOCK, Compression
from averaging.rules.robust import Aggregation
from dht.errors import DHTError
from dht.identity import is_peer_id
from dht.net.schema import is_relayed_path

MAX_GROUP_SIZE = 256
MAX_COUNT = MAX_GROUP_SIZE * MAX_GROUP_SIZE  # peers one member of a second-level group stands for
# A member accepts a leader's chunk size down to its own or this, whichever is smaller: tiny
# chunks would make it spend its CPU on frames (a frame header, a write, a tag each).
MIN_ACCEPTED_CHUNK_NUMEL = 64 * 1024
RELAY_PATH = "/v2/relay/"


@dataclass(frozen=True)
class GroupMember:
    """One member of a group.

    Attributes:
        peer_id: the member's peer id.
        address: its URL, or None for a client-mode peer (it reduces no part).
        bandwidth: its relative share of the reduction work (ignored for client-mode peers).
        weight: the weight of its contribution (samples); 0 means it contributes nothing but
            still receives the average and reduces its part.
        count: how many peers its contribution stands for (1; a row's size for a delegate at
            the second level). A claim, used only to report coverage.
    """

    peer_id: str
    address: str | None
    bandwidth: float = 1.0
    weight: float = 1.0
    count: int = 1

    @property
    def client_mode(self) -> bool:
        return self.address is None

    @property
    def relayed(self) -> bool:
        """Whether it is reached through a relay (``.../v2/relay/{peer id}``)."""
        return self.address is not None and is_relayed_path(urlsplit(self.address).path)

    def to_wire(self) -> dict[str, Any]:
        wire = {"peer": self.peer_id, "addr": self.address, "bw": self.bandwidth, "w": self.weight}
        if self.count != 1:
            wire["n"] = self.count
        return wire

    @classmethod
    def from_wire(cls, raw: Any) -> GroupMember:
        """Parse a member received from the network.

        Raises:
            ProtocolViolation: a field is missing or malformed.
        """
        if not isinstance(raw, Mapping):
            raise ProtocolViolation("group member is not a map")
        peer_id, address = raw.get("peer"), raw.get("addr")
        bandwidth, weight = raw.get("bw"), raw.get("w")
        if not is_peer_id(peer_id):
            raise ProtocolViolation(f"bad peer id in group: {str(peer_id)[:80]!r}")
        if address is not None and not check_address(address):
            raise ProtocolViolation("a member address must be http(s)://host:port")
        if not valid_bandwidth(bandwidth):
            raise ProtocolViolation("member bandwidth must be a finite number in [0, 1e12]")
        if not valid_weight(weight):
            raise ProtocolViolation("member weight must be 0 or a finite number in [2**-20, 2**53]")
        count = raw.get("n", 1)
        if not (isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= MAX_COUNT):
            raise ProtocolViolation(f"member count must be an integer in [1, {MAX_COUNT}]")
        return cls(peer_id, address, float(bandwidth), float(weight), count)


@dataclass(frozen=True)
class GroupInfo:
    """A group as its leader announced it; every member derives the same partition from it.

    Attributes:
        group_id: random hex string naming this group's round.
        members: the members, ordered by peer id; part ``i`` is reduced by ``members[i]``.
        compression: the wire format every member uses this round.
        chunk_numel: the most values per chunk (small parts use smaller chunks).
        aggregation: how reducers combine the contributions (:mod:`averaging.rules.robust`).
        max_weight_ratio: a weight counts at most this many times the lower median weight.
        num_streams: how many streams (TCP connections) each sender opens to each reducer; the
            reducer's part is cut into that many slices of whole chunks, one per stream.
        top_rows: 0 when this group is the whole round; else the rows the round's second level
            expects: after the all-reduce, the group's delegate (:attr:`delegate`) averages the
            group's mean with the other rows' and every member takes the result from it
            (:mod:`averaging.levels`).
        num_reducers: 0: every member with an address reduces a part; else only the first
            this many of them (in member order) do, and the others only send and receive. A
            leader sets it for a group larger than its target group size (the delegates of a
            round's rows, one per row): with each of n members streaming to each of n
            reducers, a top round of 70 delegates on one loaded host opened about 4,800
            streams at once and dropped members that could not connect in time.
    """

    group_id: str
    members: tuple[GroupMember, ...]
    compression: Compression = Compression.NONE
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    aggregation: Aggregation = Aggregation.MEAN
    max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO
    num_streams: int = 1
    top_rows: int = 0
    num_reducers: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", Compression(self.compression))
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))
        object.__setattr__(self, "members", tuple(self.members))
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ProtocolViolation("a peer appears twice in the group")
        if ids != sorted(ids):
            raise ProtocolViolation("group members are not ordered by peer id")
        addresses = [m.address for m in self.members if m.address is not None]
        if len(set(addresses)) != len(addresses):
            raise ProtocolViolation("two members of the group share an address")
        ratio = self.max_weight_ratio
        if not (is_number(ratio) and 1 <= ratio <= MAX_WEIGHT_RATIO):
            raise ProtocolViolation(f"bad weight ratio {self.max_weight_ratio!r}")
        if not (
            isinstance(self.chunk_numel, int)
            and UINT8_BLOCK <= self.chunk_numel <= MAX_CHUNK_NUMEL
            and self.chunk_numel % UINT8_BLOCK == 0
        ):
            raise ProtocolViolation(f"bad chunk size {self.chunk_numel!r}")
        if not (
            isinstance(self.num_streams, int)
            and not isinstance(self.num_streams, bool)
            and 1 <= self.num_streams <= MAX_STREAMS_PER_PAIR
        ):
            raise ProtocolViolation(f"bad number of streams {self.num_streams!r}")
        if not (
            isinstance(self.top_rows, int)
            and not isinstance(self.top_rows, bool)
            and 0 <= self.top_rows <= MAX_GROUP_SIZE
        ):
            raise ProtocolViolation(f"bad number of rows {self.top_rows!r}")
        if not (
            isinstance(self.num_reducers, int)
            and not isinstance(self.num_reducers, bool)
            and 0 <= self.num_reducers <= len(addresses)
        ):
            raise ProtocolViolation(f"bad number of reducers {self.num_reducers!r}")
        if self.top_rows and self.aggregation is not Aggregation.MEAN:
            raise ProtocolViolation("only a weighted mean is exact over two levels")

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(m.peer_id for m in self.members)

    def index_of(self, peer_id: str) -> int:
        for index, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return index
        raise KeyError(peer_id)

    def member(self, peer_id: str) -> GroupMember:
        return self.members[self.index_of(peer_id)]

    @property
    def delegate(self) -> str:
        """The member that takes the group's mean to the second level: the first (by peer id)
        with an address, the same for every member (client-mode peers serve no requests)."""
        return next(m.peer_id for m in self.members if not m.client_mode)

    def parts(self, total_numel: int) -> list[Part]:
        """One part per member (empty for client-mode peers), sized by its fair bandwidth
        (:func:`averaging.bounds.fair_bandwidths`).

        Raises:
            ProtocolViolation: no member can reduce (every bandwidth is 0).
        """
        bandwidths = fair_bandwidths([0.0 if m.client_mode else m.bandwidth for m in self.members])
        if self.num_reducers:  # the first num_reducers members with an address, in order
            reducers = [i for i, m in enumerate(self.members) if not m.client_mode]
            for i in reducers[self.num_reducers :]:
                bandwidths[i] = 0.0
        try:
            return make_parts(total_numel, bandwidths, self.chunk_numel)
        except (ValueError, OverflowError, ZeroDivisionError) as e:
            raise ProtocolViolation(f"the group cannot be partitioned: {e}") from None

    def stream_parts(self, total_numel: int) -> list[list[Part]]:
        """Each member's part (:meth:`parts`) cut into its streams' slices
        (:func:`averaging.matchmaking.partition.split_streams`); an empty part has no slice.

        A relayed reducer's part takes one stream whatever :attr:`num_streams` says: every
        stream to it crosses its relay's one tunnel (more flows add nothing there), and each
        holds one of the few request slots the relay gives a caller's address
        (``max_relayed_requests_per_address``): two senders behind one address with four
        streams each filled them, and the next request was refused.

        Raises:
            ProtocolViolation: no member can reduce.
        """
        parts = self.parts(total_numel)
        return [
            split_streams(part, 1 if member.relayed else self.num_streams) if part.numel else []
            for part, member in zip(parts, self.members, strict=True)
        ]

    def weights(self) -> dict[str, float]:
        """Each member's weight as every member uses it (bounded relative to the group)."""
        bounded = bounded_weights([m.weight for m in self.members], self.max_weight_ratio)
        return dict(zip(self.peer_ids, bounded, strict=True))

    def to_wire(self) -> dict[str, Any]:
        return {
            "group": self.group_id,
            "members": [m.to_wire() for m in self.members],
            "compression": self.compression.value,
            "chunk": self.chunk_numel,
            "agg": self.aggregation.value,
            "wr": self.max_weight_ratio,
            "streams": self.num_streams,
            **({"top": self.top_rows} if self.top_rows else {}),
            **({"reducers": self.num_reducers} if self.num_reducers else {}),
        }

    @classmethod
    def from_wire(cls, raw: Any) -> GroupInfo:
        """Parse a group received from the network.

        Raises:
            ProtocolViolation: malformed, empty, too large, or a peer listed twice.
        """
        if not isinstance(raw, Mapping):
            raise ProtocolViolation("group is not a map")
        group_id, members = raw.get("group"), raw.get("members")
        if not (isinstance(group_id, str) and 0 < len(group_id) <= 64):
            raise ProtocolViolation("bad group id")
        if not (isinstance(members, list) and 0 < len(members) <= MAX_GROUP_SIZE):
            raise ProtocolViolation("group members must be a non-empty list")
        try:
            compression = Compression(raw.get("compression"))
        except ValueError:
            raise ProtocolViolation("unknown compression in group") from None
        parsed = tuple(GroupMember.from_wire(m) for m in members)
        if all(m.client_mode for m in parsed):
            raise ProtocolViolation("a group needs at least one member with an address")
        chunk_numel = raw.get("chunk")
        if isinstance(chunk_numel, bool):
            raise ProtocolViolation("bad chunk size")
        try:
            aggregation = Aggregation(raw.get("agg"))
        except ValueError:
            raise ProtocolViolation("unknown aggregation in group") from None
        ratio = raw.get("wr")
        if not is_number(ratio):
            raise ProtocolViolation("bad weight ratio in group")
        num_streams, top_rows = raw.get("streams", 1), raw.get("top", 0)
        return cls(
            group_id,
            parsed,
            compression,
            chunk_numel,
            aggregation,
            float(ratio),
            num_streams,
            top_rows,
            raw.get("reducers", 0),
        )


def num_reducers(members: Sequence[GroupMember], target_group_size: int) -> int:
    """What a leader writes into a group of ``members`` (:attr:`GroupInfo.num_reducers`): its
    target group size when more members than that could reduce, else 0 (every one of them)."""
    addressed = sum(not m.client_mode for m in members)
    return target_group_size if addressed > target_group_size else 0


def check_offered(
    group: GroupInfo,
    *,
    me: GroupMember,
    leader: tuple[str, str],
    max_size: int,
    aggregation: Aggregation,
    max_weight_ratio: float,
    numel: int,
    max_streams: int = MAX_STREAMS_PER_PAIR,
    chunk_numel: int = MIN_ACCEPTED_CHUNK_NUMEL,
    min_reducers: int = 1,
) -> None:
    """Refuse a group a follower cannot take part in honestly: it must list the follower ``me``
    exactly as it sent itself, and the leader (``(peer id, address)``) as it answered; be no
    larger than ``max_size``; use the follower's aggregation rule and weight bound; open at
    most ``max_streams`` streams per reducer; cut chunks no smaller than the follower's own
    ``chunk_numel`` or :data:`MIN_ACCEPTED_CHUNK_NUMEL`; spread the reduction over at least
    ``min_reducers`` members (or all, if fewer: a leader must not take the whole vector to a
    few reducers of its choosing); and partition ``numel`` values (by fair bandwidths). Its
    structure (sorted unique ids, distinct addresses, bounded entries) was checked by
    :meth:`GroupInfo.from_wire`.

    Raises:
        ProtocolViolation, KeyError: the group is refused.
    """
    mine = group.member(me.peer_id)  # KeyError if we are not in it
    if (mine.weight, mine.address, mine.bandwidth, mine.count) != (
        me.weight,
        me.address,
        me.bandwidth,
        me.count,
    ):
        raise ProtocolViolation("the group misrepresents this peer")
    if group.member(leader[0]).address != leader[1]:
        raise ProtocolViolation("the group misrepresents its leader")
    if len(group.members) > max_size:
        raise ProtocolViolation(f"a group of {len(group.members)} is larger than allowed")
    if group.aggregation != aggregation:
        raise ProtocolViolation(f"the group aggregates by {group.aggregation.value}")
    if group.max_weight_ratio != max_weight_ratio:
        raise ProtocolViolation(f"the group bounds weights at {group.max_weight_ratio:g}x")
    if group.num_streams > max_streams:
        raise ProtocolViolation(f"the group asks for {group.num_streams} streams per pair")
    if group.chunk_numel < min(chunk_numel, MIN_ACCEPTED_CHUNK_NUMEL):
        raise ProtocolViolation(f"the group cuts chunks of {group.chunk_numel} values")
    if 0 < group.num_reducers < min_reducers:
        raise ProtocolViolation(f"the group has only {group.num_reducers} reducers")
    group.parts(numel)


def membership_refusal(
    member: GroupMember, *, sender: str, remote_host: str, taken: Iterable[str | None]
) -> str | None:
    """Why a leader refuses ``member`` as a follower, or None to seat it.

    Its id must be the proven ``sender``; its address (client-mode peers have none) must be
    one no other member of the group has (``taken``: the leader's and the seated followers'),
    a relayed address must name its own peer id, and a direct one whose host is an IP must be
    the host the request came from (``remote_host``; "" when not known, as through a relay).
    """
    if member.peer_id != sender:
        return "the member is not the peer that sent the request"
    address = member.address
    if address is None:
        return None
    if address in taken:
        return "another member of the group has this address"
    parts = urlsplit(address)
    if parts.path.startswith(RELAY_PATH):
        if parts.path.rstrip("/") != RELAY_PATH + member.peer_id:
            return "a relayed address must name the member's own peer id"
    elif remote_host and not _same_ip(parts.hostname or "", remote_host):
        return "the address is not on the host the request came from"
    return None


async def serves_at(transport: Any, address: str, peer_id: str, *, timeout_s: float) -> bool:
    """Whether ``peer_id`` proves itself at ``address``: by the transport's current session
    there if it has one (free), else by a fresh handshake (one round trip). Settles which of
    two followers claiming one address owns it."""
    known = transport.peer_at(address)
    if known is not None:
        return known == peer_id
    dial = getattr(transport, "dial", None)
    if dial is None:  # a test double that cannot dial: the all-reduce's proven calls decide
        return True
    try:
        await dial(address, expected_peer=peer_id, timeout_s=timeout_s)
    except DHTError:
        return False
    return True


def _same_ip(claimed: str, source: str) -> bool:
    try:
        claimed_ip, source_ip = ipaddress.ip_address(claimed), ipaddress.ip_address(source)
    except ValueError:
        return True  # a DNS name (or an unknown source): the all-reduce's proven calls decide
    claimed_ip = getattr(claimed_ip, "ipv4_mapped", None) or claimed_ip
    source_ip = getattr(source_ip, "ipv4_mapped", None) or source_ip
    return claimed_ip == source_ip


def distinct_members(members: Iterable[GroupMember]) -> tuple[list[GroupMember], list[str]]:
    """``members`` in peer id order, without a second member of the same id or address (the
    first listed keeps it: put the leader first): (those kept, the ids left out)."""
    kept: list[GroupMember] = []
    left_out: list[str] = []
    ids: set[str] = set()
    addresses: set[str] = set()
    for member in members:
        if member.peer_id in ids or (member.address is not None and member.address in addresses):
            left_out.append(member.peer_id)
            continue
        ids.add(member.peer_id)
        if member.address is not None:
            addresses.add(member.address)
        kept.append(member)
    kept.sort(key=lambda m: m.peer_id)
    return kept, left_out
