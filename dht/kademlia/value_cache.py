"""The values a node recently read through lookups, answering ``get(latest=False)``."""

from __future__ import annotations

import time
from collections import OrderedDict

from dht.kademlia.storage import Entry, without_expired


class ValueCache:
    """Entries this node recently read through lookups, for ``get(latest=False)``.

    Args:
        max_entries: the most keys cached; the least recently read is dropped first.
        max_age_s: how long (monotonic seconds) a cached read may answer for the network.
        monotonic: the clock ages are measured on.
    """

    def __init__(self, max_entries: int, max_age_s: float, monotonic=time.monotonic):
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._monotonic = monotonic
        self._entries: OrderedDict[int, tuple[Entry, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key_id: int, entry: Entry) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key_id] = (entry, self._monotonic())
        self._entries.move_to_end(key_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key_id: int, now: float) -> Entry | None:
        """A fresh cached entry with its expired records removed, or None."""
        cached = self._entries.get(key_id)
        if cached is None:
            return None
        entry, read_at_s = cached
        alive = without_expired(entry, now)
        if alive is None or self._monotonic() - read_at_s > self.max_age_s:
            del self._entries[key_id]
            return None
        self._entries.move_to_end(key_id)
        return alive

    def invalidate(self, key_id: int) -> None:
        self._entries.pop(key_id, None)
