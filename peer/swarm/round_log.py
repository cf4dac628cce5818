"""Each peer's recent averaging rounds on the DHT (``{run_id}/rounds``): the publisher.

The record's format and parser are :mod:`peer.records.rounds`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dht.config import get_dht_time
from dht.errors import ConfigError
from dht.kademlia.node import DHTNode
from dht.owned_record import OwnedRecord
from peer.records.buckets import record_key
from peer.records.rounds import (
    ROUNDS_RECORDS_PER_BUCKET,
    RoundEntry,
    RoundLogRecord,
    group_name,
    parse_rounds,
    rounds_key,
)

logger = logging.getLogger(__name__)

__all__ = ["RoundLog", "RoundLogConfig", "group_name", "parse_rounds", "rounds_key"]


@dataclass(frozen=True, kw_only=True)
class RoundLogConfig:
    """How a peer publishes its rounds.

    Attributes:
        target_batch_size: samples per swarm epoch (published so that readers know it).
        max_rounds: rounds kept and published.
        publish_interval_s: how often the publisher checks for news, in seconds.
        record_ttl_s: a record expires this long after it is stored, in seconds; an unchanged
            record is stored again after a third of it.
    """

    target_batch_size: int
    max_rounds: int = 10
    publish_interval_s: float = 2.0
    record_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.target_batch_size < 1:
            raise ConfigError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        if self.max_rounds < 1:
            raise ConfigError(f"max_rounds must be >= 1, got {self.max_rounds}")
        for name in ("publish_interval_s", "record_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.record_ttl_s <= self.publish_interval_s:
            raise ConfigError("record_ttl_s must exceed publish_interval_s")


class RoundLog:
    """Keeps this peer's last rounds and publishes them (an async context manager).

    The training thread calls :meth:`add` and :meth:`set_epoch`; a task on the event loop
    stores the record whenever it changed, and again before it expires.
    """

    def __init__(
        self,
        *,
        dht: DHTNode,
        prefix: str,
        config: RoundLogConfig,
        num_peers: Callable[[], float] = lambda: 1.0,
    ):
        self.dht = dht
        self.prefix = rounds_key(prefix)
        self.config = config
        self._lock = threading.Lock()
        self._rounds: tuple[RoundEntry, ...] = ()
        self._epoch = 0
        self._counts = (0, 0, 0)  # rounds, failed, local steps
        self._version = 0
        self._published: tuple[int, float] | None = None  # (version, monotonic s)
        self._pending: tuple[int, float] | None = None  # what the store in flight publishes
        self._force = False
        self._store = OwnedRecord(
            dht=dht,
            # the swarm's size (as this peer counts it, on the event loop) picks the bucket
            key=lambda: record_key(
                self.prefix, dht.peer_id, num_peers(), ROUNDS_RECORDS_PER_BUCKET
            ),
            make_value=self._due_value,
            ttl_s=config.record_ttl_s,
            interval_s=config.publish_interval_s,
            name="round record",
            after=self._after_store,
        )

    def add(self, entry: RoundEntry) -> None:
        """Record a finished round (any thread)."""
        with self._lock:
            self._rounds = (*self._rounds, entry)[-self.config.max_rounds :]
            rounds, failed, local = self._counts
            self._counts = (
                rounds + 1,
                failed + (entry.status == "failed"),
                local + entry.local_fallback,
            )
            self._epoch = max(self._epoch, entry.epoch + 1)
            self._version += 1

    def set_epoch(self, epoch: int) -> None:
        """This peer is at ``epoch`` now (a state download can move it without a round)."""
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._version += 1

    def record(self) -> RoundLogRecord:
        """What would be published now."""
        with self._lock:
            rounds, failed, local = self._counts
            return RoundLogRecord(
                peer_id=self.dht.peer_id,
                time=get_dht_time(),
                epoch=self._epoch,
                target_batch_size=self.config.target_batch_size,
                num_rounds=rounds,
                num_failed_rounds=failed,
                num_local_steps=local,
                rounds=self._rounds,
            )

    async def publish(self, *, force: bool = False) -> bool:
        """Store the record if it changed or is due; True when a store happened and took."""
        self._force = force
        try:
            stored = await self._store.publish()
        finally:
            self._force = False
        await self._after_store(stored)
        return stored

    def _due_value(self, time_s: float) -> tuple[dict, float] | None:
        """The record to store, or None when it is unchanged and not yet due again."""
        version, now = self._version, time.monotonic()
        if not self._force and self._published is not None:
            last_version, last_s = self._published
            if version == last_version and now - last_s < self.config.record_ttl_s / 3:
                return None
        self._pending = (version, now)
        record = self.record()
        return record.to_wire(), record.time

    async def _after_store(self, stored: bool) -> None:
        if stored and self._pending is not None:
            self._published, self._pending = self._pending, None

    async def __aenter__(self) -> RoundLog:
        self._store.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop publishing; safe to call twice."""
        await self._store.close()


__all__ = [
    "RoundEntry",
    "RoundLog",
    "RoundLogConfig",
    "RoundLogRecord",
    "parse_rounds",
    "rounds_key",
]
