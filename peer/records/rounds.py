"""The round record (``{run_id}/rounds/{level}/{bucket}``): one peer's recent averaging
rounds, and its parser.

A training peer keeps its last rounds and stores them, with its run settings and round counters,
as one signed, expiring record under its own subkey (:func:`dht.kademlia.validation.owner_subkey`)
of its bucket (:mod:`peer.records.buckets`). The dashboard reads every bucket to show the swarm's
last rounds and the loss over time. Torch-free, like everything in :mod:`peer.records`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Annotated

from pydantic import Field

from peer.records.schema import (
    MAX_COUNT,
    Count,
    Fraction,
    Loss,
    Seconds,
    WireModel,
    owner_of,
    parse_value,
    text,
)

ROUNDS_KEY_SUFFIX = "rounds"
ROUND_STATUSES = ("ok", "partial", "alone", "failed")
# Longest reason kept in a record (a reason is one human line).
MAX_REASON_CHARS = 120
# Most round entries a record may carry (a publisher keeps its last 10).
MAX_WIRE_ROUNDS = 256
# Records a rounds bucket holds, about (up to 2 KB each at 10 rounds: some 64 KB a key).
ROUNDS_RECORDS_PER_BUCKET = 32


def group_name(members) -> str:
    """A short name of a group, the same on every member: a digest of its sorted peer ids."""
    if len(members) <= 1:
        return ""
    return hashlib.sha256(",".join(sorted(members)).encode()).hexdigest()[:8]


def rounds_key(run_id: str) -> str:
    """The prefix of a run's round keys (records live in its buckets:
    :mod:`peer.records.buckets`)."""
    return f"{run_id}/{ROUNDS_KEY_SUFFIX}"


@dataclass(frozen=True, kw_only=True)
class RoundEntry:
    """One averaging round (or local step instead of one) as one peer saw it.

    Attributes:
        epoch: the epoch the round closed (the peer entered ``epoch + 1`` after it).
        end_time: DHT time (unix seconds) when the round ended.
        status: ``ok``, ``partial`` (some of the vector kept local values or a peer was
            dropped), ``alone`` (no group: stepped on local data) or ``failed``.
        group_size: peers in the group, this one included (1 when alone or failed).
        group_id: a short name of the group, the same for all its members ("" when alone).
        duration_s: seconds spent in matchmaking and all-reduce.
        sent_bytes: tensor bytes this peer sent in the all-reduce.
        recv_bytes: tensor bytes it received.
        num_dropped: peers dropped from the round (by this peer as their reducer, or reducers
            whose part did not come back).
        averaged_fraction: share of the vector replaced by an average with other peers' values.
        loss: the peer's mean training loss over its last steps when the round ended, or None.
        reason: why the round was not ``ok`` ("" when it was).
    """

    epoch: int
    end_time: float
    status: str
    group_size: int = 1
    group_id: str = ""
    duration_s: float = 0.0
    sent_bytes: int = 0
    recv_bytes: int = 0
    num_dropped: int = 0
    averaged_fraction: float = 0.0
    loss: float | None = None
    reason: str = ""

    @property
    def local_fallback(self) -> bool:
        """The peer stepped on its own contribution only (no group, or the round failed)."""
        return self.status in ("alone", "failed")


@dataclass(frozen=True, kw_only=True)
class RoundLogRecord:
    """One peer's round record: its settings, counters and last rounds (oldest first).

    Attributes:
        peer_id: the publisher (from the signed subkey, never from the value).
        time: the publisher's DHT time when it published.
        epoch: the publisher's epoch then.
        target_batch_size: samples per swarm epoch in the publisher's settings.
        num_rounds: rounds it has finished (all statuses).
        num_failed_rounds: rounds that failed.
        num_local_steps: rounds it stepped on local data only (alone or failed).
        rounds: its last rounds, oldest first.
    """

    peer_id: str
    time: float
    epoch: int
    target_batch_size: int
    num_rounds: int = 0
    num_failed_rounds: int = 0
    num_local_steps: int = 0
    rounds: tuple[RoundEntry, ...] = field(default_factory=tuple)

    def to_wire(self) -> dict:
        """The record's value as stored on the DHT (msgpack-able; the subkey names the peer)."""
        value = asdict(self)
        del value["peer_id"]
        # A reason is the averager's error text, of any length; the reader refuses a record
        # whose reason is past its schema's bound, so the writer cuts it to what is kept.
        value["rounds"] = [
            {**asdict(entry), "reason": entry.reason[:MAX_REASON_CHARS]} for entry in self.rounds
        ]
        return value


class _EntryWire(WireModel):
    epoch: Count
    end_time: Seconds
    status: text(16)
    group_size: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    group_id: text(64) = ""
    duration_s: Seconds = 0.0
    sent_bytes: Count = 0
    recv_bytes: Count = 0
    num_dropped: Count = 0
    averaged_fraction: Fraction = 0.0
    loss: Loss = None
    reason: text(4 * MAX_REASON_CHARS) = ""

    def entry(self) -> RoundEntry:
        return RoundEntry(
            epoch=self.epoch,
            end_time=self.end_time,
            # a status of a newer publisher reads as the worst known one
            status=self.status if self.status in ROUND_STATUSES else "failed",
            group_size=self.group_size,
            group_id=self.group_id[:16],
            duration_s=self.duration_s,
            sent_bytes=self.sent_bytes,
            recv_bytes=self.recv_bytes,
            num_dropped=self.num_dropped,
            averaged_fraction=self.averaged_fraction,
            loss=self.loss,
            reason=self.reason[:MAX_REASON_CHARS],
        )


class RoundsWire(WireModel):
    """The round record's value as it travels (see the module docstring)."""

    time: Seconds
    epoch: Count
    target_batch_size: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    num_rounds: Count = 0
    num_failed_rounds: Count = 0
    num_local_steps: Count = 0
    rounds: list[_EntryWire] = Field(default_factory=list, max_length=MAX_WIRE_ROUNDS)


def parse_rounds(subkey: object, value: object, *, max_rounds: int = 64) -> RoundLogRecord | None:
    """A peer's round record from the DHT, or None (counted) if it does not fit the schema.

    At most ``max_rounds`` of the newest entries are kept; unknown fields are ignored and an
    unknown status reads as ``failed`` (newer publishers stay readable).
    """
    peer_id = owner_of(subkey)
    wire = parse_value(RoundsWire, "rounds", peer_id, value)
    if wire is None or peer_id is None:
        return None
    entries = [raw.entry() for raw in wire.rounds[-max_rounds:]] if max_rounds > 0 else []
    return RoundLogRecord(
        peer_id=peer_id,
        time=wire.time,
        epoch=wire.epoch,
        target_batch_size=wire.target_batch_size,
        num_rounds=wire.num_rounds,
        num_failed_rounds=wire.num_failed_rounds,
        num_local_steps=wire.num_local_steps,
        rounds=tuple(sorted(entries, key=lambda e: (e.epoch, e.end_time))),
    )
