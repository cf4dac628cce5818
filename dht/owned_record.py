"""A record a node owns on the DHT, stored again every few seconds.

A peer publishes several records of its own (progress, profile, rounds, state announcements):
each under its owner subkey (:func:`dht.kademlia.validation.owner_subkey`), so the node signs it and
nobody else can overwrite it, and each expiring a while after it was made, so a peer that
leaves drops out of everyone's view. :class:`OwnedRecord` is that one pattern: the owner says
how to build the value, this class stores it on a period and when asked, and a failed store is
one WARNING line and a retry at the next period, never an exception that stops the peer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dht.config import get_dht_time
from dht.errors import DHTError
from dht.kademlia.node import DHTNode
from dht.kademlia.validation import owner_subkey
from dht.periodic import Periodic

logger = logging.getLogger(__name__)
_AFTER_LAST_S = 0.001  # a re-store's expiration is at least this much past the last one sent
# (DHT time now) -> (the value to store, the DHT time it describes), or None: nothing to store.
MakeValue = Callable[[float], tuple[Any, float] | None]


class OwnedRecord:
    """One owned record, published every ``interval_s``; an async context manager on the
    node's event loop, whose ``close`` is safe twice.

    Args:
        dht: the owner's node.
        key: the DHT key (the record goes under the owner's subkey of it), or a function that
            says it at each store (a record that moves as the swarm grows; the old one
            expires).
        make_value: builds the value from the DHT time of publishing (see :data:`MakeValue`).
        ttl_s: seconds a record lives after the time it describes.
        interval_s: seconds between two stores; None publishes only when asked.
        name: what the record is, for log lines and the task's name.
        after: awaited with the outcome (stored or not) after every periodic store: the
            owner's bookkeeping, or a read of everyone's records that follows the write.
        replicas: each store goes to this many of the key's closest nodes (None: the DHT's
            ``num_replicas``; see :meth:`dht.kademlia.node.DHTNode.store`).
    """

    def __init__(
        self,
        *,
        dht: DHTNode,
        key: str | Callable[[], str],
        make_value: MakeValue,
        ttl_s: float,
        interval_s: float | None,
        name: str,
        after: Callable[[bool], Awaitable[object]] | None = None,
        replicas: int | None = None,
    ):
        if not ttl_s > 0:
            raise ValueError(f"{name}: ttl_s must be > 0, got {ttl_s}")
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"{name}: interval_s must be > 0, got {interval_s}")
        self.dht = dht
        self._key = key
        self.make_value = make_value
        self.ttl_s = ttl_s
        self.name = name
        self.num_published = 0
        self._after = after
        self.replicas = replicas
        # (key, expiration) of the last store sent: a re-store under that key must go past it,
        # or replicas that took it refuse the new value as stale (see publish)
        self._last_sent: tuple[str, float] | None = None
        # two stores racing: the older value would be refused as stale by the replicas
        self._lock = asyncio.Lock()
        self._periodic = (
            Periodic(self._tick, interval_s, f"{name}-publisher") if interval_s else None
        )

    @property
    def key(self) -> str:
        """Where the next store goes."""
        return self._key if isinstance(self._key, str) else self._key()

    async def publish(self) -> bool:
        """Store a fresh value now; False (and a warning) when no replica took it."""
        made = self.make_value(get_dht_time())
        if made is None:
            return False
        value, time_s = made
        key = self.key
        try:
            async with self._lock:
                # A shorter ttl_s than the last store's (an owner that sizes it from its recent
                # cycles) would date the new value before the one the replicas hold, and every
                # replica would refuse it as stale until the old one neared its end: at 32 peers
                # on 2 cores, tens of progress stores a run, the peer shown at an old epoch.
                expiration = time_s + self.ttl_s
                if self._last_sent is not None and self._last_sent[0] == key:
                    expiration = max(expiration, self._last_sent[1] + _AFTER_LAST_S)
                self._last_sent = (key, expiration)  # a moved record: the old key expires alone
                stored = await self.dht.store(
                    key,
                    value,
                    expiration,
                    subkey=owner_subkey(self.dht.peer_id),
                    replicas=self.replicas,
                )
        except DHTError as e:  # the next period tries again
            logger.warning("%s not stored: %s", self.name, e)
            return False
        if not stored:
            logger.warning("%s not stored: no replica accepted it", self.name)
            return False
        self.num_published += 1
        return True

    async def _tick(self) -> None:
        stored = await self.publish()
        if self._after is not None:
            await self._after(stored)

    def start(self) -> None:
        """Publish now and then every ``interval_s`` (on the event loop)."""
        if self._periodic is not None:
            self._periodic.start()

    async def __aenter__(self) -> OwnedRecord:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop publishing; safe to call twice."""
        if self._periodic is not None:
            await self._periodic.stop()
