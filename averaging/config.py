"""Settings of the averager: group formation, the all-reduce's timeouts, chunking, compression."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from averaging.bounds import (
    DEFAULT_CHUNK_NUMEL,
    DEFAULT_MAX_WEIGHT_RATIO,
    MAX_BANDWIDTH,
    MAX_CHUNK_NUMEL,
    MAX_STREAMS_PER_PAIR,
    MAX_WEIGHT_RATIO,
)
from averaging.errors import ConfigError
from averaging.rules.compression import UINT8_BLOCK, Compression
from averaging.rules.robust import Aggregation
from dht.kademlia.config import read_replicas_problem, store_replicas_problem

PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True, kw_only=True)
class AveragerConfig:
    """How a peer finds a group and averages with it.

    Attributes:
        target_group_size: a leader closes its group as soon as it has this many members.
        min_group_size: fewer members than this (the leader included) is no group: the peers
            get an "alone" result and step locally.
        matchmaking_time_s: bound on looking for a group, in seconds; a leader waits at most
            this long for followers, a follower at most this long for its group to form. With
            ``adaptive_deadlines`` the window is measured and this is its upper bound (and its
            value before anything was measured).
        matchmaking_poll_min_s: first pause between two reads of the matchmaking records in
            the DHT, in seconds; it doubles after each read up to ``matchmaking_poll_max_s``.
        matchmaking_poll_max_s: longest pause between two reads of those records, in seconds.
        request_timeout_s: bound on one matchmaking request (join, DHT store/get), in seconds.
        allreduce_timeout_s: bound on the whole all-reduce of one round, in seconds; whatever
            was not averaged by then keeps its local values (a partial round).
        sender_timeout_s: a reducer drops a sender that delivers no next chunk (or does not
            connect) for this long, in seconds, and averages the others. With
            ``adaptive_deadlines``, the value used before anything was measured.
        reducer_timeout_s: a sender gives up on a reducer that sends no next averaged chunk
            for this long, in seconds, and keeps its own values for that part. With
            ``adaptive_deadlines``, the value used before anything was measured.
        group_wait_s: how long a reducer holds an incoming stream for a group it has not yet
            heard of (its matchmaking answer may be a little behind), in seconds. With
            ``adaptive_deadlines`` it follows the sender wait.
        adaptive_deadlines: the waits above come from what this peer measured (arrival
            offsets of partners, RTTs, chunk waits; see :mod:`averaging.allreduce.deadlines`) within
            ``min_deadline_s`` and ``max_deadline_s``; False: each wait is its field.
        deadline_safety: an adaptive wait is this many times the 90th percentile of the
            recent measurements of what it waits for.
        min_deadline_s: the shortest adaptive wait, in seconds (a scheduling hiccup on a busy
            host must not look like a dead peer).
        max_deadline_s: the longest adaptive sender or reducer wait, in seconds (the sender
            wait stays at most half of it, below the reducer wait).
        chunk_numel: most values per chunk of a part (a multiple of the uint8 block, 1024, at
            most 2**21); the wire carries ``4 * chunk_numel`` bytes per chunk without
            compression. Small parts use smaller chunks. A group uses its leader's setting.
        max_chunks_in_flight: chunks of a part a reducer accumulates at once (its memory is
            this many chunks per part; senders are held back by flow control beyond it). With
            several streams per pair, per slice of the part.
        streams_per_pair: streams (TCP connections) each sender opens to each reducer, the
            part cut into that many slices of whole chunks; 0 (default): chosen from the
            measured RTT and the goodput of past rounds (:mod:`averaging.allreduce.streams`). A
            group uses its leader's choice.
        max_streams_per_pair: the most streams per pair the automatic choice takes, and the
            most this peer accepts from a leader (at most 8: a server admits 8 streams per
            peer at once).
        rtt_per_stream_s: in seconds; while the measured median RTT is below it the automatic
            choice is one stream, and its first try is one stream per this much RTT.
        offload_min_numel: numpy work on at least this many values (compression, decoding)
            runs in a worker thread, off the event loop.
        compression: wire format of the parts unless a step says otherwise.
        bandwidth: this peer's share of the reduction work relative to others' (e.g. its
            upload bandwidth in Mbit/s); parts are sized in proportion. Client-mode peers
            reduce nothing whatever this says.
        group_bits: appended to the matchmaking key (Moshpit-style sub-swarms in large runs).
        aggregation: how reducers combine contributions: ``mean`` (weighted, exact),
            ``trimmed_mean`` or ``centered_clip`` (robust to a minority of bad contributions;
            for ``grad`` mode; see :mod:`averaging.rules.robust`). A peer joins only groups that use
            its own setting.
        max_weight_ratio: a member's weight counts at most this many times the lower median
            weight of its group (see :mod:`averaging.bounds`). A peer joins only groups that
            use its own setting. At a round's second level, where a row's weight is the sum
            of its members', the bound is this times ``target_group_size`` (at most 1e6;
            :func:`top_weight_ratio`).
        relayed_reduces: whether a peer reached through a relay (see
            :meth:`dht.http.HttpTransport.attach_relay`) reduces a part. Off by default: it
            then averages as a client (sends its parts and receives the averages over its own
            outbound connections, reduces nothing), so the round does not go through the relay
            at all. On, its part's bytes cross the relay both ways, and a relay that dies
            mid-round costs that part.
        num_partner_rounds: the members of this peer's last this many rounds are its partners;
            it follows a partner's lead before a stranger's (leadership that fresh ids cannot
            grind; see :mod:`averaging.matchmaking.matchmaker`).
        row_grace_s: when a step says how many peers are ready (``expected_peers``), a leader
            closes its row at the balanced size, or, once its search has run this long, at what
            the last row holds (:mod:`averaging.matchmaking.rows`), in seconds. The delegates'
            search of the second level waits at least this long before it closes short of
            ``expected_peers`` (see ``top_quiet_s``).
        top_round_timeout_s: bound on a round's second level past the rows' end (the
            delegates' matchmaking and all-reduce; :mod:`averaging.levels`), in seconds; the
            all-reduce has at least ``allreduce_timeout_s`` within the step's bound, the same
            for every delegate. A row member waits at most both (plus ``request_timeout_s``)
            for its delegate's word before it keeps its row's mean.
        top_quiet_s: the delegates' search closes once the rows it holds stand for every ready
            peer (``expected_peers``); short of that, past ``row_grace_s``, only once every
            delegate seen is in and no delegate arrived or appeared for this long, in seconds
            (an estimate of the ready peers too high, or a row that failed, costs this much).
        read_replicas: each read of the matchmaking key merges this many of the key's closest
            replicas (None: all of the DHT's ``num_replicas``). Every announcement goes to all
            of them, so the closest few hold each one a store placed; each one more is one more
            request per read, and a search reads every half second or so. 8 by default: at 64
            busy peers, 9-11% less CPU per round and 13-21% shorter rounds than all 20, with the
            same coverage (docs/BENCHMARKS.md, "Matchmaking reads of the 8 closest replicas").
        store_replicas: each announcement goes to this many of the key's closest nodes (None:
            all ``num_replicas``); at least ``read_replicas``, so that a writer whose lookup saw
            the key's neighbourhood a little differently still reaches the ones readers merge.
            12 by default, as ``ProgressConfig.store_replicas``.
    """

    target_group_size: int = 16
    min_group_size: int = 2
    matchmaking_time_s: float = 5.0
    matchmaking_poll_min_s: float = 0.01
    matchmaking_poll_max_s: float = 0.5
    request_timeout_s: float = 5.0
    allreduce_timeout_s: float = 60.0
    sender_timeout_s: float = 5.0
    reducer_timeout_s: float = 10.0
    group_wait_s: float = 5.0
    adaptive_deadlines: bool = True
    deadline_safety: float = 4.0
    min_deadline_s: float = 1.0
    max_deadline_s: float = 120.0
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    max_chunks_in_flight: int = 4
    streams_per_pair: int = 0
    max_streams_per_pair: int = 4
    rtt_per_stream_s: float = 0.02
    offload_min_numel: int = 65536
    compression: Compression = Compression.NONE
    bandwidth: float = 1.0
    group_bits: str = ""
    aggregation: Aggregation = Aggregation.MEAN
    max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO
    relayed_reduces: bool = False
    num_partner_rounds: int = 8
    row_grace_s: float = 1.0
    top_round_timeout_s: float = 30.0
    top_quiet_s: float = 1.0
    read_replicas: int | None = 8
    store_replicas: int | None = 12

    def __post_init__(self) -> None:
        for name in ("read_replicas", "store_replicas"):
            if problem := read_replicas_problem(getattr(self, name)):
                raise ConfigError(f"{name} {problem}")
        if problem := store_replicas_problem(self.store_replicas, self.read_replicas):
            raise ConfigError(f"store_replicas {problem}")
        try:
            object.__setattr__(self, "compression", Compression(self.compression))
        except ValueError:
            raise ConfigError(
                f"compression must be one of none, fp16, uint8; got {self.compression!r}"
            ) from None
        for name in ("target_group_size", "min_group_size", "max_chunks_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_group_size > self.target_group_size:
            raise ConfigError(
                f"min_group_size ({self.min_group_size}) must not exceed target_group_size "
                f"({self.target_group_size})"
            )
        for name in (
            "matchmaking_time_s",
            "matchmaking_poll_min_s",
            "matchmaking_poll_max_s",
            "request_timeout_s",
            "allreduce_timeout_s",
            "sender_timeout_s",
            "reducer_timeout_s",
            "group_wait_s",
            "min_deadline_s",
            "max_deadline_s",
            "row_grace_s",
            "top_round_timeout_s",
            "top_quiet_s",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if self.reducer_timeout_s <= self.sender_timeout_s:
            # A reducer waits up to sender_timeout_s for a slow sender before it can answer.
            raise ConfigError(
                f"reducer_timeout_s ({self.reducer_timeout_s}) must exceed sender_timeout_s "
                f"({self.sender_timeout_s})"
            )
        if self.group_wait_s >= self.reducer_timeout_s:
            # A sender gives up on a reducer that holds its stream longer than this.
            raise ConfigError(
                f"group_wait_s ({self.group_wait_s}) must be less than reducer_timeout_s "
                f"({self.reducer_timeout_s})"
            )
        self._check_deadline_bounds()
        self._check_streams()
        if self.matchmaking_poll_min_s > self.matchmaking_poll_max_s:
            raise ConfigError("matchmaking_poll_min_s must not exceed matchmaking_poll_max_s")
        if not UINT8_BLOCK <= self.chunk_numel <= MAX_CHUNK_NUMEL or self.chunk_numel % UINT8_BLOCK:
            raise ConfigError(
                f"chunk_numel must be a multiple of {UINT8_BLOCK} in [{UINT8_BLOCK}, "
                f"{MAX_CHUNK_NUMEL}], got {self.chunk_numel}"
            )
        if self.offload_min_numel < 0:
            raise ConfigError(f"offload_min_numel must be >= 0, got {self.offload_min_numel}")
        if not 0 < self.bandwidth <= MAX_BANDWIDTH:
            raise ConfigError(f"bandwidth must be in (0, 1e12], got {self.bandwidth}")
        try:
            object.__setattr__(self, "aggregation", Aggregation(self.aggregation))
        except ValueError:
            raise ConfigError(
                f"aggregation must be one of mean, trimmed_mean, centered_clip; "
                f"got {self.aggregation!r}"
            ) from None
        if not 1 <= self.max_weight_ratio <= MAX_WEIGHT_RATIO:
            raise ConfigError(f"max_weight_ratio must be in [1, 1e6], got {self.max_weight_ratio}")
        if self.num_partner_rounds < 0:
            raise ConfigError(f"num_partner_rounds must be >= 0, got {self.num_partner_rounds}")
        if self.group_bits and not set(self.group_bits) <= {"0", "1"}:
            raise ConfigError(f"group_bits must be a string of 0s and 1s, got {self.group_bits!r}")

    def _check_streams(self) -> None:
        if not 1 <= self.max_streams_per_pair <= MAX_STREAMS_PER_PAIR:
            raise ConfigError(
                f"max_streams_per_pair must be in [1, {MAX_STREAMS_PER_PAIR}], "
                f"got {self.max_streams_per_pair}"
            )
        if not 0 <= self.streams_per_pair <= self.max_streams_per_pair:
            raise ConfigError(
                f"streams_per_pair must be 0 (automatic) or in [1, max_streams_per_pair="
                f"{self.max_streams_per_pair}], got {self.streams_per_pair}"
            )
        if not (self.rtt_per_stream_s > 0 and math.isfinite(self.rtt_per_stream_s)):
            raise ConfigError(
                f"rtt_per_stream_s must be a positive number of seconds, got "
                f"{self.rtt_per_stream_s}"
            )

    def _check_deadline_bounds(self) -> None:
        if not isinstance(self.adaptive_deadlines, bool):
            raise ConfigError(
                f"adaptive_deadlines must be True or False, got {self.adaptive_deadlines!r}"
            )
        if not (1 <= self.deadline_safety <= 100 and math.isfinite(self.deadline_safety)):
            raise ConfigError(f"deadline_safety must be in [1, 100], got {self.deadline_safety}")
        if self.max_deadline_s < 2 * self.min_deadline_s:
            # the sender wait lies in [min, max / 2] and the reducer wait is twice it
            raise ConfigError(
                f"max_deadline_s ({self.max_deadline_s}) must be at least twice min_deadline_s "
                f"({self.min_deadline_s})"
            )


def top_weight_ratio(config: AveragerConfig) -> float:
    """The weight bound of a round's second level: a row weighs the sum of at most
    ``target_group_size`` members' weights, so rows of similar peers stay well within it, while
    one delegate still cannot make itself the whole average (:mod:`averaging.bounds`)."""
    return min(MAX_WEIGHT_RATIO, config.max_weight_ratio * config.target_group_size)


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a valid averager name (letters, digits, ``_.-``; 1 to 64 chars)."""
    if not isinstance(prefix, str) or not PREFIX_PATTERN.fullmatch(prefix):
        raise ConfigError(f"prefix must match {PREFIX_PATTERN.pattern}, got {prefix!r}")
    return prefix


def reducing_address(transport: Any, config: AveragerConfig) -> str | None:
    """Where this peer reduces its part: its address, or None when it averages as a client
    (client mode, or relayed unless ``config.relayed_reduces``)."""
    if getattr(transport, "relayed", False) and not config.relayed_reduces:
        return None
    return transport.address
