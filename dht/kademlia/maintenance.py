"""A DHT node's own upkeep: bucket refresh and republishing, as tasks the node owns."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from dht.kademlia.config import DHTConfig
from dht.kademlia.messages import StoreRequest
from dht.kademlia.routing import DHTID, RoutingTable
from dht.kademlia.storage import DHTStorage, Record
from dht.net.schema import MAX_RECORDS_PER_STORE

logger = logging.getLogger(__name__)


class MaintainedNode(Protocol):
    """What upkeep needs of its node (:class:`dht.kademlia.node.DHTNode`, which owns it)."""

    config: DHTConfig
    routing: RoutingTable
    storage: DHTStorage

    async def lookup(self, target: int, *, want_value: bool) -> Any: ...

    async def replicate(self, key_id: int, requests: list[StoreRequest]) -> Any: ...


class Maintenance:
    """Runs the periodic refresh and republish of one node until closed."""

    def __init__(self, node: MaintainedNode):
        self._node = node
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        if self._tasks:
            return
        config = self._node.config
        self._tasks = [
            asyncio.create_task(self._every(config.refresh_interval_s, self.refresh)),
            asyncio.create_task(self._every(config.republish_interval_s, self.republish)),
        ]

    async def close(self) -> None:
        """Cancel the loops and wait for them; safe to call twice."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _every(self, interval_s: float, job) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:  # a bug in one round must not end the node's upkeep for good
                logger.exception("%r: %s failed", self._node, job.__name__)

    async def refresh(self) -> int:
        """Purge expired records; look up a random id in every bucket idle for an interval.

        Returns:
            The number of buckets refreshed.
        """
        node = self._node
        node.storage.purge_expired()
        stale = node.routing.stale_buckets(node.config.refresh_interval_s)
        for bucket in stale:
            await node.lookup(DHTID.random(bucket.lower, bucket.upper), want_value=False)
        return len(stale)

    async def republish(self) -> int:
        """Store again every held key that no one re-stored during the last interval.

        Returns:
            The number of keys republished.
        """
        node = self._node
        since_s = time.monotonic() - node.config.republish_interval_s
        num_keys = 0
        for key_id in node.storage.keys():
            entry = node.storage.get(key_id)
            if entry is None or node.storage.updated_at_s(key_id) > since_s:
                continue
            items = [(None, entry)] if isinstance(entry, Record) else list(entry.items())
            requests = [StoreRequest(key_id, subkey, record) for subkey, record in items]
            for start in range(0, len(requests), MAX_RECORDS_PER_STORE):
                await node.replicate(key_id, requests[start : start + MAX_RECORDS_PER_STORE])
            num_keys += 1
        return num_keys
