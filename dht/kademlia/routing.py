"""Kademlia ids and the routing table: k-buckets with least-recently-seen eviction.

A bucket keeps its entries in the order they were last seen (oldest first). When a full bucket
meets a new node, the table does not decide alone: it keeps the newcomer in the bucket's
replacement cache and names the oldest entry, which the node pings. An answer moves the oldest
entry to the back (alive nodes are never evicted for newcomers, Kademlia's bias towards long-lived
nodes); a failure removes it and promotes the freshest replacement.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache

from dht.errors import ConfigError
from dht.net.schema import ID_BYTES

ID_BITS = ID_BYTES * 8
MAX_ID = 1 << ID_BITS


class DHTID(int):
    """A 160-bit Kademlia id: node ids derive from peer ids, key ids from keys."""

    @classmethod
    def from_peer_id(cls, peer_id: str) -> DHTID:
        """The node id of a peer: sha1 of its raw 32-byte public key."""
        return _node_id_of(peer_id)

    @classmethod
    def from_key(cls, key: str | bytes) -> DHTID:
        """The id a key is stored under: sha1 of its utf-8 bytes (bytes are hashed as they are)."""
        if isinstance(key, str):
            raw = key.encode()
        elif isinstance(key, bytes | bytearray | memoryview):
            raw = bytes(key)
        else:
            raise TypeError(f"a DHT key is str or bytes, got {type(key).__name__}")
        return cls(int.from_bytes(hashlib.sha1(raw).digest(), "big"))

    @classmethod
    def from_raw(cls, raw: bytes) -> DHTID:
        """The id whose big-endian 20-byte form is ``raw`` (as it travels on the wire)."""
        if len(raw) != ID_BYTES:
            raise ValueError(f"a DHT id is {ID_BYTES} bytes, got {len(raw)}")
        return cls(int.from_bytes(raw, "big"))

    @classmethod
    def random(cls, lower: int = 0, upper: int = MAX_ID) -> DHTID:
        """A uniformly random id in ``[lower, upper)``."""
        span = upper - lower
        return cls(lower + int.from_bytes(os.urandom(ID_BYTES + 8), "big") % span)

    def to_raw(self) -> bytes:
        """The big-endian 20-byte form of this id."""
        return self.to_bytes(ID_BYTES, "big")

    def xor_distance(self, other: int) -> int:
        return int(self) ^ int(other)

    def __repr__(self) -> str:
        return f"DHTID({self.to_raw().hex()[:10]})"


@lru_cache(maxsize=65536)
def _node_id_of(peer_id: str) -> DHTID:
    # Every find answer carries up to k peer ids; hashing each again would show in profiles.
    return DHTID(int.from_bytes(hashlib.sha1(bytes.fromhex(peer_id)).digest(), "big"))


@dataclass(frozen=True)
class PeerInfo:
    """How to reach one DHT node: its ids and its URL."""

    peer_id: str
    address: str
    node_id: DHTID = field(compare=False, repr=False)

    @classmethod
    def of(cls, peer_id: str, address: str) -> PeerInfo:
        return cls(peer_id, address, DHTID.from_peer_id(peer_id))


class KBucket:
    """Up to ``size`` nodes with ids in ``[lower, upper)``, oldest-seen first."""

    def __init__(self, lower: int, upper: int, size: int):
        self.lower = lower
        self.upper = upper
        self.size = size
        self.nodes: OrderedDict[int, PeerInfo] = OrderedDict()
        self.replacements: OrderedDict[int, PeerInfo] = OrderedDict()
        self.seen_at_s: dict[int, float] = {}  # of nodes and replacements, time.monotonic
        self.last_updated_s = time.monotonic()

    def covers(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def is_full(self) -> bool:
        return len(self.nodes) >= self.size

    def oldest(self) -> PeerInfo:
        return next(iter(self.nodes.values()))

    def split(self) -> tuple[KBucket, KBucket]:
        middle = (self.lower + self.upper) // 2
        left, right = KBucket(self.lower, middle, self.size), KBucket(middle, self.upper, self.size)
        for source, attr in ((self.nodes, "nodes"), (self.replacements, "replacements")):
            for node_id, peer in source.items():
                half = left if node_id < middle else right
                getattr(half, attr)[node_id] = peer
                half.seen_at_s[node_id] = self.seen_at_s[node_id]
        for half in (left, right):
            half.last_updated_s = self.last_updated_s
            # A split can leave a half with room and replacements waiting: promote them.
            while half.replacements and not half.is_full():
                node_id, peer = half.replacements.popitem(last=True)
                half.nodes[node_id] = peer
        return left, right


class RoutingTable:
    """The k-buckets of one node.

    Args:
        own_id: this node's id; the bucket that covers it is the only one that splits.
        bucket_size: k, the most nodes per bucket (and per replacement cache).
        liveness_check_after_s: a full bucket asks for a ping of its least recently seen node
            only if that node has been silent this long (monotonic seconds); a node heard from
            more recently is presumed alive, which spares a ping per newcomer in busy swarms.
    """

    def __init__(self, own_id: DHTID, bucket_size: int, liveness_check_after_s: float = 0.0):
        if bucket_size < 1:
            raise ConfigError(f"bucket_size must be >= 1, got {bucket_size}")
        self.own_id = own_id
        self.bucket_size = bucket_size
        self.liveness_check_after_s = liveness_check_after_s
        self.buckets: list[KBucket] = [KBucket(0, MAX_ID, bucket_size)]
        self._peers: dict[int, PeerInfo] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._peers

    def get(self, node_id: int) -> PeerInfo | None:
        return self._peers.get(node_id)

    def peers(self) -> list[PeerInfo]:
        return list(self._peers.values())

    def bucket_of(self, node_id: int) -> KBucket:
        lo, hi = 0, len(self.buckets) - 1
        while lo < hi:  # buckets are sorted and contiguous
            mid = (lo + hi) // 2
            if node_id < self.buckets[mid].upper:
                hi = mid
            else:
                lo = mid + 1
        return self.buckets[lo]

    def add_or_update(self, peer: PeerInfo) -> PeerInfo | None:
        """Record that ``peer`` was just seen.

        Returns:
            None if the peer is now in the table (added or moved to the back of its bucket);
            otherwise the bucket is full and the peer waits in the replacement cache, and the
            return value is the bucket's least recently seen node, which the caller should ping
            (then :meth:`mark_alive` or :meth:`remove` it).
        """
        if peer.node_id == self.own_id:
            return None
        now = time.monotonic()
        while True:
            bucket = self.bucket_of(peer.node_id)
            bucket.last_updated_s = now
            bucket.seen_at_s[peer.node_id] = now
            known = bucket.nodes.get(peer.node_id)
            if known is not None:
                if known.address != peer.address:
                    bucket.nodes[peer.node_id] = peer
                    self._peers[peer.node_id] = peer
                bucket.nodes.move_to_end(peer.node_id)
                return None
            if not bucket.is_full():
                bucket.nodes[peer.node_id] = peer
                bucket.replacements.pop(peer.node_id, None)
                self._peers[peer.node_id] = peer
                return None
            if bucket.covers(self.own_id) and bucket.upper - bucket.lower > 1:
                self._split(bucket)
                continue
            bucket.replacements.pop(peer.node_id, None)
            bucket.replacements[peer.node_id] = peer
            while len(bucket.replacements) > self.bucket_size:
                dropped_id, _ = bucket.replacements.popitem(last=False)
                del bucket.seen_at_s[dropped_id]
            oldest = bucket.oldest()
            if now - bucket.seen_at_s[oldest.node_id] < self.liveness_check_after_s:
                return None
            return oldest

    def mark_alive(self, node_id: int) -> None:
        """The node answered: move it to the back of its bucket."""
        bucket = self.bucket_of(node_id)
        if node_id in bucket.nodes:
            bucket.nodes.move_to_end(node_id)
            bucket.seen_at_s[node_id] = time.monotonic()

    def remove(self, node_id: int) -> bool:
        """Forget a node that failed to answer; promote the freshest replacement in its place.

        Returns:
            True if the node was in the table.
        """
        bucket = self.bucket_of(node_id)
        bucket.replacements.pop(node_id, None)
        if bucket.nodes.pop(node_id, None) is None:
            bucket.seen_at_s.pop(node_id, None)
            return False
        del bucket.seen_at_s[node_id]
        del self._peers[node_id]
        if bucket.replacements:
            promoted_id, promoted = bucket.replacements.popitem(last=True)
            bucket.nodes[promoted_id] = promoted
            self._peers[promoted_id] = promoted
        return True

    def nearest(self, target: int, count: int, exclude: int | None = None) -> list[PeerInfo]:
        """Up to ``count`` known nodes closest to ``target`` by xor distance, closest first."""
        # Sorting ints with a C-level key beats a heap of Python-level keys at these sizes.
        ranked = sorted(self._peers, key=int(target).__xor__)
        peers = self._peers
        return [peers[node_id] for node_id in ranked[: count + 1] if node_id != exclude][:count]

    def stale_buckets(self, max_age_s: float) -> list[KBucket]:
        """Buckets that saw no node for ``max_age_s`` seconds (due for a refresh lookup)."""
        now = time.monotonic()
        return [b for b in self.buckets if now - b.last_updated_s >= max_age_s]

    def _split(self, bucket: KBucket) -> None:
        index = self.buckets.index(bucket)
        self.buckets[index : index + 1] = bucket.split()
        for half in self.buckets[index : index + 2]:
            for node_id, peer in half.nodes.items():
                self._peers[node_id] = peer
