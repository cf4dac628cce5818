"""What one node holds: the records it replicates (the values it recently read are in
:mod:`dht.kademlia.value_cache`).

A key holds either one plain record or a dictionary of records by subkey. Records carry their
value as packed msgpack bytes (exactly as the writer packed them, so replicas never re-serialize)
and a wall-clock expiration time. Conflicts resolve the same way on every replica, so replicas
converge whatever order stores arrive in:

* a newer expiration wins; an older one never overwrites (this is also what refuses a replayed
  old record); an equal expiration keeps the larger value bytes, and the same record again is an
  accepted no-op (a republish);
* a plain record and a dictionary under one key: the newer expiration wins (a dictionary's
  expiration is that of its newest subkey), the loser is dropped whole, except that records
  under owner subkeys (signed, see :mod:`dht.kademlia.subkeys`) always beat a plain record: anyone
  may write a plain value, so one must neither wipe nor block a key that peers sign records under;
* expired records vanish from reads at once and are purged as their expirations pass.

Bytes are bounded as well as records: in all, per key, per owner (the peer an owner subkey
names, across keys), and for records anyone may write (per key and in all), so no writer can
take a key or the node's memory from the others.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from dht.errors import BadMessageError, ConfigError
from dht.kademlia.config import Clock
from dht.kademlia.subkeys import Subkey, subkey_owner
from dht.net.wire import MessageLimits, unpack

logger = logging.getLogger(__name__)

T = TypeVar("T")
# What a held record costs beyond its value and subkey (expiration, signature, bookkeeping).
RECORD_OVERHEAD_BYTES = 128
ANONYMOUS = ""  # the "owner" of records anyone may write


class ValueWithExpiration(NamedTuple, Generic[T]):
    """A value read from the DHT and the wall-clock unix time (seconds) at which it expires;
    a named pair, so ``value, expiration_time = dht.get(key)`` works as in hivemind."""

    value: T
    expiration_time: float


@dataclass(frozen=True)
class Record:
    """One stored value: packed msgpack bytes, expiration (unix s), and the owner's signature.

    ``signature`` is set only for subkeys bound to a peer (see :mod:`dht.kademlia.validation`).
    """

    value_bytes: bytes
    expiration_time: float
    signature: bytes | None = None

    def order(self) -> tuple[float, bytes]:
        return self.expiration_time, self.value_bytes


Entry = Record | dict[Subkey, Record]


def entry_expiration(entry: Entry) -> float:
    """The expiration of a plain record, or of a dictionary's newest subkey."""
    if isinstance(entry, Record):
        return entry.expiration_time
    return max((r.expiration_time for r in entry.values()), default=float("-inf"))


def supersedes(new: Record, old: Record) -> bool | None:
    """True if ``new`` replaces ``old``, None if they are the same record, False otherwise."""
    if new.order() == old.order():
        return None
    return new.order() > old.order()


def without_expired(entry: Entry, now: float) -> Entry | None:
    """``entry`` with its expired records removed, or None if nothing is left."""
    if isinstance(entry, Record):
        return entry if entry.expiration_time > now else None
    alive = {subkey: r for subkey, r in entry.items() if r.expiration_time > now}
    return alive or None


def decode_entry(
    entry: Entry | None, limits: MessageLimits, now: float, key: object = "?"
) -> ValueWithExpiration | None:
    """What a reader sees: unexpired values unpacked; a dictionary as {subkey: value}.

    A dictionary's expiration is that of its newest subkey. Values that do not unpack under
    ``limits`` are left out (and logged with ``key``).
    """
    if entry is None:
        return None
    if isinstance(entry, Record):
        return _unpack(entry, limits, now, key)
    values = {}
    for subkey, record in entry.items():
        unpacked = _unpack(record, limits, now, key)
        if unpacked is not None:
            values[subkey] = unpacked
    if not values:
        return None
    return ValueWithExpiration(values, max(v.expiration_time for v in values.values()))


def _unpack(
    record: Record, limits: MessageLimits, now: float, key: object
) -> ValueWithExpiration | None:
    if record.expiration_time <= now:
        return None
    try:
        value = unpack(record.value_bytes, limits, tuples=True)  # stored tuples stay tuples
        return ValueWithExpiration(value, record.expiration_time)
    except BadMessageError as e:
        logger.warning("undecodable value under %r ignored: %s", key, e)
        return None


def merge_entries(a: Entry | None, b: Entry | None) -> Entry | None:
    """Combine what two replicas answered by the same rules a replica applies to stores."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, Record) and isinstance(b, Record):
        return b if supersedes(b, a) else a
    if isinstance(a, dict) and isinstance(b, dict):
        merged = dict(a)
        for subkey, record in b.items():
            old = merged.get(subkey)
            if old is None or supersedes(record, old):
                merged[subkey] = record
        return merged
    for entry in (a, b):  # a replica never lets a plain value wipe peers' signed records
        if isinstance(entry, dict) and _holds_owned(entry):
            return entry
    return b if entry_expiration(b) > entry_expiration(a) else a


def _holds_owned(entry: dict[Subkey, Record]) -> bool:
    return any(subkey_owner(subkey) is not None for subkey in entry)


def record_cost(subkey: Subkey | None, record: Record) -> int:
    """The bytes one held record counts for."""
    if isinstance(subkey, str):
        subkey_bytes = len(subkey.encode())
    else:
        subkey_bytes = len(subkey) if isinstance(subkey, bytes) else 8 * (subkey is not None)
    return len(record.value_bytes) + subkey_bytes + RECORD_OVERHEAD_BYTES


def charges(entry: Entry | None) -> dict[str, int]:
    """Bytes of ``entry`` by owner (:data:`ANONYMOUS` for records anyone may write)."""
    if entry is None:
        return {}
    if isinstance(entry, Record):
        return {ANONYMOUS: record_cost(None, entry)}
    out: dict[str, int] = {}
    for subkey, record in entry.items():
        owner = subkey_owner(subkey) or ANONYMOUS
        out[owner] = out.get(owner, 0) + record_cost(subkey, record)
    return out


class DHTStorage:
    """The records this node replicates.

    Args:
        clock: wall clock for expirations (unix seconds).
        max_records: the most records held (a plain key counts one, a dictionary one per
            subkey); stores of new records beyond it are refused.
        max_expiration_ahead_s: records expiring further than this in the future are refused.
        max_bytes: the most bytes held in all (:func:`record_cost` of every record).
        max_bytes_per_key: the most bytes held under one key.
        max_bytes_per_owner: the most bytes held under one peer's owner subkeys, all keys together.
        max_unowned_bytes_per_key: the most bytes of records anyone may write, under one key.
        max_unowned_bytes: the most bytes of records anyone may write, all keys together.

    A store that would go over a cap is refused (stores that shrink what is held never are).
    """

    def __init__(
        self,
        clock: Clock,
        max_records: int,
        *,
        max_expiration_ahead_s: float = float("inf"),
        max_bytes: int = 256 * 2**20,
        max_bytes_per_key: int = 2**20,
        max_bytes_per_owner: int = 2**20,
        max_unowned_bytes_per_key: int = 64 * 2**10,
        max_unowned_bytes: int = 16 * 2**20,
    ):
        if max_records < 1:
            raise ConfigError(f"max_records must be >= 1, got {max_records}")
        self._clock = clock
        self.max_records = max_records
        self.max_expiration_ahead_s = max_expiration_ahead_s
        self.max_bytes = max_bytes
        self.max_bytes_per_key = max_bytes_per_key
        self.max_bytes_per_owner = max_bytes_per_owner
        self.max_unowned_bytes_per_key = max_unowned_bytes_per_key
        self.max_unowned_bytes = max_unowned_bytes
        self._data: dict[int, Entry] = {}
        self._num_records = 0
        self.num_bytes = 0
        self._owner_bytes: dict[str, int] = {}
        self._key_bytes: dict[int, int] = {}  # what charges() of each held entry sums to
        self._key_unowned_bytes: dict[int, int] = {}  # its ANONYMOUS part
        self._expirations: list[tuple[float, int]] = []  # a heap; entries may be outdated
        self._updated_at_s: dict[int, float] = {}

    def __len__(self) -> int:
        """The number of records held (expired ones not yet purged included)."""
        return self._num_records

    def owner_bytes(self, owner: str) -> int:
        """Bytes held under ``owner``'s subkeys (:data:`ANONYMOUS`: records anyone may write)."""
        return self._owner_bytes.get(owner, 0)

    def store(self, key_id: int, record: Record, subkey: Subkey | None = None) -> bool:
        """Apply one store by the conflict rules above, within the caps.

        Returns:
            True if the record is now held (stored, or the very same record was already there).
        """
        now = self._clock.time()
        self.purge_expired(now)
        if not now < record.expiration_time <= now + self.max_expiration_ahead_s:
            return False
        old = self._data.get(key_id)
        if subkey is None:
            new = self._store_plain(old, record)
        else:
            new = self._store_subkey(old, subkey, record)
        if new is None:
            return False
        if new is not old:
            if subkey is not None and isinstance(old, dict) and isinstance(new, dict):
                # One subkey added or replaced: charge its difference alone, so that a store
                # costs the same under a key of 3 records or of 3000.
                change = _subkey_change(subkey, record, old.get(subkey))
            else:
                change = _change(old, new)
            if not self._fits(key_id, change):
                return False
            self._replace(key_id, new, change)
            heapq.heappush(self._expirations, (record.expiration_time, key_id))
        # The same record again is a republish by another replica: ours can wait.
        self._updated_at_s[key_id] = time.monotonic()
        return True

    def _fits(self, key_id: int, change: _Change) -> bool:
        if change.num_records > 0 and self._num_records + change.num_records > self.max_records:
            return False
        delta_bytes = sum(change.bytes_by_owner.values())
        key_bytes = self._key_bytes.get(key_id, 0) + delta_bytes
        if delta_bytes > 0 and (
            key_bytes > self.max_bytes_per_key or self.num_bytes + delta_bytes > self.max_bytes
        ):
            return False
        for owner, delta in change.bytes_by_owner.items():
            if delta <= 0:
                continue
            if owner == ANONYMOUS:
                if self._key_unowned_bytes.get(key_id, 0) + delta > self.max_unowned_bytes_per_key:
                    return False
                cap = self.max_unowned_bytes
            else:
                cap = self.max_bytes_per_owner
            if self._owner_bytes.get(owner, 0) + delta > cap:
                return False
        return True

    def _replace(self, key_id: int, new: Entry | None, change: _Change) -> None:
        for owner, delta in change.bytes_by_owner.items():
            _add(self._owner_bytes, owner, delta)
            if owner == ANONYMOUS:
                _add(self._key_unowned_bytes, key_id, delta)
        delta_bytes = sum(change.bytes_by_owner.values())
        self.num_bytes += delta_bytes
        _add(self._key_bytes, key_id, delta_bytes)
        self._num_records += change.num_records
        if new is None:
            self._data.pop(key_id, None)
            self._updated_at_s.pop(key_id, None)
        else:
            self._data[key_id] = new

    def _store_plain(self, old: Entry | None, record: Record) -> Entry | None:
        if old is None:
            return record
        if isinstance(old, Record):
            verdict = supersedes(record, old)
            return old if verdict is None else (record if verdict else None)
        if _holds_owned(old):
            return None  # anyone may write a plain value: it must not wipe peers' signed records
        return record if record.expiration_time > entry_expiration(old) else None

    def _store_subkey(self, old: Entry | None, subkey: Subkey, record: Record) -> Entry | None:
        if old is None:
            return {subkey: record}
        if isinstance(old, Record):
            # A plain value must not block signed records either: a stranger could otherwise
            # squat a predictable key (a future round's matchmaking key) for days.
            owned = subkey_owner(subkey) is not None
            return (
                {subkey: record} if owned or record.expiration_time > old.expiration_time else None
            )
        existing = old.get(subkey)
        if existing is not None:
            verdict = supersedes(record, existing)
            if verdict is None:
                return old
            if not verdict:
                return None
        return {**old, subkey: record}

    def get(self, key_id: int) -> Entry | None:
        """The unexpired record (or dictionary of records) under ``key_id``."""
        entry = self._data.get(key_id)
        if entry is None:
            return None
        return without_expired(entry, self._clock.time())

    def keys(self) -> list[int]:
        return list(self._data)

    def updated_at_s(self, key_id: int) -> float:
        """When (``time.monotonic``) a store last changed ``key_id``; -inf if it never did."""
        return self._updated_at_s.get(key_id, float("-inf"))

    def purge_expired(self, now: float | None = None) -> int:
        """Drop every record whose expiration has passed; returns how many were dropped."""
        now = self._clock.time() if now is None else now
        num_before = self._num_records
        while self._expirations and self._expirations[0][0] <= now:
            _, key_id = heapq.heappop(self._expirations)
            entry = self._data.get(key_id)
            if entry is not None:
                alive = without_expired(entry, now)
                self._replace(key_id, alive, _change(entry, alive))
        if len(self._expirations) > 4 * self._num_records + 64:
            # Overwritten records leave outdated heap entries behind; rebuild from what is held.
            self._expirations = [
                (r.expiration_time, k)
                for k, e in self._data.items()
                for r in (e.values() if isinstance(e, dict) else (e,))
            ]
            heapq.heapify(self._expirations)
        return num_before - self._num_records


def _count(entry: Entry | None) -> int:
    if entry is None:
        return 0
    return 1 if isinstance(entry, Record) else len(entry)


class _Change(NamedTuple):
    """What a store changes in the counts: bytes by owner, and records."""

    bytes_by_owner: dict[str, int]
    num_records: int


def _change(old: Entry | None, new: Entry | None) -> _Change:
    """The change from ``old`` to ``new``, counted over every record of both."""
    bytes_by_owner = charges(new)
    for owner, num_bytes in charges(old).items():
        bytes_by_owner[owner] = bytes_by_owner.get(owner, 0) - num_bytes
    return _Change(bytes_by_owner, _count(new) - _count(old))


def _subkey_change(subkey: Subkey, record: Record, replaced: Record | None) -> _Change:
    """The change of writing ``record`` under ``subkey`` over ``replaced`` (None: a new one)."""
    delta = record_cost(subkey, record) - (record_cost(subkey, replaced) if replaced else 0)
    return _Change({subkey_owner(subkey) or ANONYMOUS: delta}, 0 if replaced else 1)


def _add(counts: dict[T, int], key: T, delta: int) -> None:
    held = counts.get(key, 0) + delta
    if held:
        counts[key] = held
    else:
        counts.pop(key, None)
