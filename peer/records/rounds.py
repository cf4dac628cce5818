"""The round record (``{run_id}/rounds``): one peer's recent averaging rounds, and its parser.

A training peer keeps its last rounds and stores them, with its run settings and round counters,
as one signed, expiring record under its own subkey (:func:`dht.validation.owner_subkey`). The
dashboard reads the whole dictionary to show the swarm's last rounds and the loss over time.
Torch-free, like everything in :mod:`peer.records`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

from dht.validation import subkey_owner

ROUNDS_KEY_SUFFIX = "rounds"
ROUND_STATUSES = ("ok", "partial", "alone", "failed")
# Longest reason kept in a record (a reason is one human line).
MAX_REASON_CHARS = 120


def group_name(members) -> str:
    """A short name of a group, the same on every member: a digest of its sorted peer ids."""
    if len(members) <= 1:
        return ""
    return hashlib.sha256(",".join(sorted(members)).encode()).hexdigest()[:8]


def rounds_key(run_id: str) -> str:
    """The DHT key of a run's round records."""
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
        value["rounds"] = [asdict(entry) for entry in self.rounds]
        return value


def _number(value: object, *, low: float = 0.0, high: float = math.inf) -> float:
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError("not finite")
    return min(max(number, low), high)


def _count(value: object) -> int:
    return int(_number(value, high=2**62))


def _parse_entry(raw: object) -> RoundEntry | None:
    if not isinstance(raw, dict):
        return None
    try:
        status = str(raw["status"])
        loss = raw.get("loss")
        return RoundEntry(
            epoch=_count(raw["epoch"]),
            end_time=_number(raw["end_time"]),
            status=status if status in ROUND_STATUSES else "failed",
            group_size=max(1, _count(raw.get("group_size", 1))),
            group_id=str(raw.get("group_id", ""))[:16],
            duration_s=_number(raw.get("duration_s", 0.0)),
            sent_bytes=_count(raw.get("sent_bytes", 0)),
            recv_bytes=_count(raw.get("recv_bytes", 0)),
            num_dropped=_count(raw.get("num_dropped", 0)),
            averaged_fraction=_number(raw.get("averaged_fraction", 0.0), high=1.0),
            loss=None if loss is None else _number(loss, low=-math.inf),
            reason=str(raw.get("reason", ""))[:MAX_REASON_CHARS],
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def parse_rounds(subkey: object, value: object, *, max_rounds: int = 64) -> RoundLogRecord | None:
    """A peer's round record from the DHT, or None if it is malformed.

    Numbers are clamped to plausible ranges, malformed round entries are skipped, at most
    ``max_rounds`` of the newest entries are kept and unknown fields are ignored (newer
    publishers stay readable).
    """
    peer_id = subkey_owner(subkey) if isinstance(subkey, str) else None
    if peer_id is None or not isinstance(value, dict):
        return None
    raw_rounds = value.get("rounds", [])
    if not isinstance(raw_rounds, list):
        return None
    entries = [entry for entry in map(_parse_entry, raw_rounds[-max_rounds:]) if entry]
    try:
        return RoundLogRecord(
            peer_id=peer_id,
            time=_number(value["time"]),
            epoch=_count(value["epoch"]),
            target_batch_size=max(1, _count(value["target_batch_size"])),
            num_rounds=_count(value.get("num_rounds", 0)),
            num_failed_rounds=_count(value.get("num_failed_rounds", 0)),
            num_local_steps=_count(value.get("num_local_steps", 0)),
            rounds=tuple(sorted(entries, key=lambda e: (e.epoch, e.end_time))),
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
