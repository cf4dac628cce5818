"""The nodes that took a key's last store, so that the next store of that key skips its lookup.

A record rewritten every few seconds (a peer's progress, a matchmaking announcement) went through
a lookup before every store: finds until the ``alpha`` closest nodes answered, then the stores.
At 16 light peers those finds were about a seventh of a peer's DHT requests, and a lookup gets
deeper as the swarm grows. The nodes that answered the last store of a key are its replicas
until the swarm changes around the key, and a store's answer names the closest nodes its
receiver knows, so stores sent to the remembered set carry the lookup on by themselves
(:mod:`dht.kademlia.lookup`): a closer node that joined meanwhile gets the value too, and a
node that left is passed over for the next closest, as in a lookup. A set is forgotten after
``max_age_s`` (counted from the lookup that found it), and at once when fewer nodes than the
replicas answered a store: the next store looks the key up again.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from dht.kademlia.routing import PeerInfo

# Keys remembered at most; the least recently stored is forgotten first.
MAX_KEYS = 1024


class ReplicaSets:
    """Per key, the nodes that answered its last store, for ``max_age_s`` monotonic seconds.

    Args:
        max_age_s: how long a set stands in for a lookup, in seconds (0: never).
        max_keys: the most keys remembered.
        monotonic: the clock ages are measured on.
    """

    def __init__(self, max_age_s: float, max_keys: int = MAX_KEYS, monotonic=time.monotonic):
        self.max_age_s = max_age_s
        self.max_keys = max_keys
        self._monotonic = monotonic
        self._sets: OrderedDict[int, tuple[list[PeerInfo], float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sets)

    def get(self, key_id: int) -> list[PeerInfo] | None:
        """The nodes that answered the last store of ``key_id``, if recent enough."""
        remembered = self._sets.get(key_id)
        if remembered is None:
            return None
        nodes, stored_at_s = remembered
        if self._monotonic() - stored_at_s > self.max_age_s:
            del self._sets[key_id]
            return None
        return list(nodes)

    def seeds(self, key_id: int, nearest: list[PeerInfo], k: int) -> list[PeerInfo] | None:
        """Where a store of ``key_id`` starts without a lookup: its remembered set and the
        ``nearest`` nodes known, the ``k`` closest of them; None when no set is remembered."""
        known = self.get(key_id)
        if known is None:
            return None
        merged = {p.node_id: p for p in nearest} | {p.node_id: p for p in known}
        return sorted(merged.values(), key=lambda p: p.node_id ^ key_id)[:k]

    def put(self, key_id: int, nodes: list[PeerInfo]) -> None:
        """Remember ``nodes`` (every one answered a store of ``key_id`` just now)."""
        if self.max_age_s <= 0 or not nodes:
            return
        if key_id not in self._sets:  # a set's age counts from the lookup that found it
            self._sets[key_id] = (list(nodes), self._monotonic())
        else:
            self._sets[key_id] = (list(nodes), self._sets[key_id][1])
        self._sets.move_to_end(key_id)
        while len(self._sets) > self.max_keys:
            self._sets.popitem(last=False)

    def forget(self, key_id: int) -> None:
        self._sets.pop(key_id, None)
