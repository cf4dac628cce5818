"""Publishes a peer's profile record on the DHT every few seconds (``{run_id}/profile``).

The record (:class:`peer.records.profile.ProfileRecord`) goes under this peer's owner subkey, so
the node signs it and nobody else can overwrite it; it expires ``ttl_s`` after it was made, so a
peer that leaves drops out of the swarm's view. A failed store is logged and retried at the
next period: publishing never stops the peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dht.config import get_dht_time
from dht.errors import DHTError
from dht.node import DHTNode
from dht.validation import owner_subkey
from peer.records.profile import ProfileRecord, profile_key
from peer.swarm.periodic import Periodic

logger = logging.getLogger(__name__)
# A record outlives this many publishing periods (and at least MIN_TTL_S) before it expires.
TTL_PERIODS = 4
MIN_TTL_S = 20.0


class ProfilePublisher:
    """An async context manager on the peer's event loop; ``close`` is safe twice.

    Args:
        dht: this peer's DHT node.
        run_id: the run (the key's prefix).
        make_record: builds the record from the DHT time (unix seconds) of publishing.
        interval_s: seconds between two records.
        ttl_s: seconds a record lives (default: ``max(4 * interval_s, 20)``).
    """

    def __init__(
        self,
        *,
        dht: DHTNode,
        run_id: str,
        make_record: Callable[[float], ProfileRecord],
        interval_s: float,
        ttl_s: float | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.dht = dht
        self.key = profile_key(run_id)
        self.make_record = make_record
        self.ttl_s = ttl_s if ttl_s is not None else max(TTL_PERIODS * interval_s, MIN_TTL_S)
        self.num_published = 0
        self.last_record: ProfileRecord | None = None
        self._periodic = Periodic(self.publish, interval_s, "profile-publisher")

    async def publish(self) -> bool:
        """Store one fresh record now; False (and a warning) if no replica took it."""
        record = self.make_record(get_dht_time())
        try:
            stored = await self.dht.store(
                self.key,
                record.to_wire(),
                record.time + self.ttl_s,
                subkey=owner_subkey(record.peer_id),
            )
        except DHTError as e:
            logger.warning("profile record not stored: %s", e)
            return False
        if not stored:
            logger.warning("profile record not stored: no replica accepted it")
            return False
        self.num_published += 1
        self.last_record = record
        return True

    async def start(self) -> None:
        """Publish now and then every ``interval_s`` (must run on the event loop)."""
        self._periodic.start()

    async def __aenter__(self) -> ProfilePublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop publishing; safe to call twice."""
        await self._periodic.stop()
