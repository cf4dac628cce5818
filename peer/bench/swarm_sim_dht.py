"""The DHT of :mod:`peer.bench.swarm_sim`: who stores a key, what a store or a read costs whom.

An explicit simplification of :mod:`dht.kademlia` (whose every RPC, signature and routing table
is too heavy for 10,000 nodes in one process for minutes of virtual time):

* Every peer is a DHT node with the real node id (:meth:`dht.kademlia.routing.DHTID.from_peer_id`)
  and a key lives on its ``k`` closest live nodes by XOR distance (on the top 64 bits), as
  Kademlia has it (``k`` is the DHT's ``num_replicas``). A key's records are kept once (the
  replicas agree); a record outlives its writer until it expires (``k`` replicas rarely all
  leave within a record's lifetime).
* Costs are the real node's, measured over :mod:`dht.tools.memory` (real node code, packing
  and signatures; ``CostModel`` says how): a lookup is ``k`` RPCs to the key's replicas plus a
  few hops that grow with ``log2(N)``, each to a random node; ``get(latest=True)`` has every
  replica answer with the whole value (or the closest ``read_replicas``, as the configs have
  it); a store sends the signed record to every replica (or the closest ``store_replicas``).
* A node's bytes are both sides of every RPC it makes or answers (what the bench counts).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from dht.kademlia.config import DHTConfig
from dht.kademlia.routing import DHTID, ID_BITS


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Bytes and RPCs of the real DHT (bucket size 20), measured with 100 and 400 nodes over
    :mod:`dht.tools.memory`: 16 signed progress records stored from 16 nodes under one key,
    then read by 10 others with ``get(latest=True)`` (and an empty key read, for the routing
    alone); bytes are one side of each RPC (request plus answer bodies). Measured with 20
    replicas; a lookup's path to the key's neighbourhood is the same with fewer.

    Attributes:
        k: replicas of a key (the DHT's ``num_replicas``).
        find_rpc_bytes: one find RPC that carries no value (request and ``k`` contacts).
        store_rpc_bytes: one store RPC of one signed record (and the contacts it answers).
        record_bytes: one signed record in a replica's answer (value, subkey, signature).
        rpcs_at_100: RPCs of one lookup among 100 nodes, beyond the ``k`` replicas.
        rpcs_per_doubling: the RPCs a lookup adds each time the swarm doubles.
    """

    k: int = DHTConfig().num_replicas
    find_rpc_bytes: int = 1650
    store_rpc_bytes: int = 1840
    record_bytes: int = 250
    rpcs_at_100: float = 2.5
    rpcs_per_doubling: float = 1.3

    def hop_rpcs(self, num_nodes: int) -> int:
        """RPCs of a lookup to nodes other than the key's replicas."""
        extra = self.rpcs_at_100 + self.rpcs_per_doubling * math.log2(max(num_nodes, 2) / 100)
        return max(0, round(extra))


class SimDHT:
    """Keys, their replicas and every node's bytes (see the module docstring)."""

    def __init__(self, cost: CostModel, rng: random.Random, capacity: int):
        self.cost = cost
        self.rng = rng
        self.slots: dict[str, int] = {}  # peer id -> slot in the arrays below
        self._num_slots = 0
        capacity = max(16, capacity)
        self._ids = np.zeros(capacity, dtype=np.uint64)
        self._alive = np.zeros(capacity, dtype=bool)
        self.node_bytes = np.zeros(capacity, dtype=np.float64)
        self._alive_slots: list[int] = []
        self._alive_array: np.ndarray | None = None  # the same, for drawing (None: stale)
        self._np_rng = np.random.default_rng(rng.getrandbits(64))
        # key -> (slots of its k closest live nodes, the k-th distance, the key's id)
        self._replicas: dict[str, tuple[np.ndarray, int, int]] = {}
        self.records: dict[str, dict[str, tuple[object, float]]] = {}  # key -> peer -> value
        self.max_key_records = 0

    @property
    def num_alive(self) -> int:
        return len(self._alive_slots)

    def join(self, peer_id: str) -> int:
        slot = self._num_slots
        if slot == len(self._ids):
            self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
            self._alive = np.concatenate([self._alive, np.zeros_like(self._alive)])
            self.node_bytes = np.concatenate([self.node_bytes, np.zeros_like(self.node_bytes)])
        self._num_slots += 1
        node_id = _top64(DHTID.from_peer_id(peer_id))
        self._ids[slot] = node_id
        self._alive[slot] = True
        self.slots[peer_id] = slot
        self._alive_slots.append(slot)
        self._alive_array = None
        for key, (_, kth, key_id) in list(self._replicas.items()):  # a closer node takes it
            if node_id ^ key_id < kth:
                del self._replicas[key]
        return slot

    def leave(self, peer_id: str) -> None:
        slot = self.slots[peer_id]
        self._alive[slot] = False
        self._alive_slots.remove(slot)
        self._alive_array = None
        for key, (replicas, _, _) in list(self._replicas.items()):
            if slot in replicas:
                del self._replicas[key]

    def replicas(self, key: str) -> np.ndarray:
        found = self._replicas.get(key)
        if found is None:
            key_id = _top64(DHTID.from_key(key))
            alive = np.flatnonzero(self._alive[: self._num_slots])
            distance = self._ids[alive] ^ np.uint64(key_id)
            k = min(self.cost.k, len(alive))
            nearest = np.argpartition(distance, k - 1)[:k] if k else np.arange(0)
            nearest = nearest[np.argsort(distance[nearest])]  # closest first
            kth = int(distance[nearest].max()) if k else 2**64
            found = (alive[nearest], kth, key_id)
            self._replicas[key] = found
        return found[0]

    def _route(
        self, client: int, key: str, rpc_bytes: float, num_replicas: int | None = None
    ) -> np.ndarray:
        """Bill a lookup's hops (random nodes) and return the replicas it reaches (the
        ``num_replicas`` closest; None: every one)."""
        hops = self.cost.hop_rpcs(self.num_alive)
        if self._alive_array is None:
            self._alive_array = np.array(self._alive_slots)
        drawn = self._alive_array[self._np_rng.integers(0, len(self._alive_array), hops)]
        self.node_bytes[drawn] += self.cost.find_rpc_bytes  # (a node drawn twice: billed once)
        self.node_bytes[client] += hops * self.cost.find_rpc_bytes
        replicas = self.replicas(key)[:num_replicas]
        self.node_bytes[replicas] += rpc_bytes
        self.node_bytes[client] += len(replicas) * rpc_bytes
        return replicas

    def store(
        self,
        client: int,
        key: str,
        owner: str,
        value: object,
        expiration: float,
        replicas: int | None = None,
    ) -> None:
        """``owner``'s record under ``key`` on the ``replicas`` closest replicas (None: every
        one; the key's records are kept once, so a reader of fewer still finds it)."""
        self._route(client, key, self.cost.store_rpc_bytes, replicas)
        held = self.records.setdefault(key, {})
        held[owner] = (value, expiration)
        self.max_key_records = max(self.max_key_records, len(held))

    def get(self, client: int, key: str, now: float, replicas: int | None = None) -> list:
        """Every unexpired record under ``key``, each of the ``replicas`` closest replicas (None:
        every one) answering with all of them."""
        held = self.records.get(key, {})
        for owner in [o for o, (_, expiration) in held.items() if expiration <= now]:
            del held[owner]
        value_bytes = len(held) * self.cost.record_bytes
        self._route(client, key, self.cost.find_rpc_bytes + value_bytes, replicas)
        return [value for value, _ in held.values()]

    def bytes_of(self, peer_ids) -> list[float]:
        """The bytes of each of these nodes so far."""
        return [float(self.node_bytes[self.slots[p]]) for p in peer_ids]

    def max_key_bytes(self) -> int:
        """The most bytes one key held at any time (records times their size)."""
        return self.max_key_records * self.cost.record_bytes


def _top64(node_id: int) -> int:
    return int(node_id) >> (ID_BITS - 64)
