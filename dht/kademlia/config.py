"""Settings of a DHT node, and the wall clock that expirations are measured on."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dht.errors import BadMessageError, ConfigError
from dht.net.schema import parse_address


class Clock(Protocol):
    """Where expiration times come from: unix seconds that mean the same on every node."""

    def time(self) -> float: ...


class SystemClock:
    """The machine's wall clock (``time.time``); expirations are compared across machines."""

    def time(self) -> float:
        return time.time()


def read_replicas_problem(replicas: object) -> str | None:
    """Why ``replicas`` cannot be a reader's count of replicas to merge (``DHTNode.get(...,
    replicas=)``), None when it can: None (all of them) or an integer of at least 1."""
    if replicas is None or (type(replicas) is int and replicas >= 1):
        return None
    return f"must be None or >= 1, got {replicas!r}"


def store_replicas_problem(store: int | None, read: int | None) -> str | None:
    """Why a writer's count of replicas ``store`` cannot go with readers that merge ``read``
    (None: all of them), None when it can: readers merge the closest ``read`` nodes of their
    own lookups, so a writer must reach at least as many (None, every replica, always does)."""
    if store is None:
        return None
    if read is None or store < read:
        return f"must be None or at least the read replicas ({read}), got {store}"
    return None


def get_dht_time() -> float:
    """The current DHT time: wall-clock unix seconds, what expiration times are measured on."""
    return time.time()


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    """How a DHT node finds others, replicates values and maintains itself.

    Attributes:
        initial_peers: URLs of nodes to bootstrap from (``http://host:port``); empty for the
            first node of a swarm.
        bucket_size: k, the most nodes per k-bucket and the size of a lookup's result set.
        alpha: how many requests a lookup keeps in flight at once.
        num_replicas: how many of the closest nodes each store goes to, and how many a
            ``latest`` read merges; at most ``bucket_size`` (a larger value is lowered to it).
            20 (``bucket_size``) by default: with 5 (hivemind's), a young swarm's writers and
            readers disagreed on the closest nodes, and a top round closed without every row
            (``tests/averaging/test_levels.py``). Every store and every ``latest`` read moves
            one copy per replica: 5 cut a light peer's DHT traffic about 2.3x at 16 peers
            (docs/BENCHMARKS.md, "Swarm at scale").
        refresh_interval_s: how often buckets that saw no traffic are refreshed by a lookup of a
            random id in their range, in seconds (also how often expired records are purged).
        republish_interval_s: how often held records that no one else re-stored meanwhile are
            stored again to the current closest nodes, in seconds.
        cache_max_age_s: how long a value read through a lookup may answer ``get(latest=False)``
            without asking the network again, in seconds.
        cache_max_entries: the most keys kept in that cache (0 disables it).
        replica_set_max_age_s: how long the nodes that answered a key's last store take the
            next store of that key without a lookup first, in seconds, counted from the lookup
            that found them (0: a lookup before every store). Their answers still name any
            closer node (:mod:`dht.kademlia.replica_sets`).
        max_value_bytes: the largest packed value accepted, in bytes (stores and answers).
        max_records: the most records one node holds for others.
        max_storage_bytes: the most bytes of records one node holds for others, in bytes
            (a record counts its value, its subkey and 128 bytes of overhead).
        max_bytes_per_key: the most bytes held under one key, in bytes.
        max_bytes_per_owner: the most bytes held under one peer's owner subkeys (all keys
            together), in bytes.
        max_unowned_bytes_per_key: the most bytes of records anyone may write (plain values,
            subkeys that name no owner) under one key, in bytes; signed records keep the rest.
        max_unowned_bytes: the most bytes of records anyone may write, all keys together.
        lookup_timeout_s: bound on one whole lookup (every hop), in seconds; a lookup that
            reaches it returns what it found so far.
        max_nodes_per_answer: a find or store answer naming more nodes than this is refused
            whole (honest nodes name at most their bucket size).
        max_pending_verifications: senders' claimed addresses being pinged back at once, at
            most (a node enters the routing table only once it answered at its address);
            claims beyond it wait for the sender's next request.
        max_signature_checks: record signatures waiting in (or being checked by) the node's
            signature-check queue at most, from everyone together: the queue takes store
            requests' new signatures and find answers' batches, one worker thread in turns
            per source address and per peer (:mod:`dht.kademlia.record_checks`).
        max_signature_checks_per_peer: the share of that queue of one proven peer id; a store
            request whose new signatures do not fit is refused at once (429).
        max_signature_checks_per_address: the share of one source address (an IPv6 /64).
        max_signature_checks_per_s_per_peer: signatures one proven peer id may have checked per
            second (bursts of a second's worth): the queue's turns are fair among those that
            wait, but one sender alone would keep its worker (a core) busy; beyond it a store
            is refused at once (429). (Answers to this node's own lookups have only the queue
            share.)
        max_signature_checks_per_s_per_address: the same for one source address (an IPv6 /64).
        rpc_timeout_s: bound on one DHT request to another node, in seconds.
        bootstrap_timeout_s: bound on reaching the initial peers when starting, in seconds.
        liveness_check_after_s: a full bucket pings its least recently seen node before
            preferring a newcomer only if that node has been silent this long, in seconds.
        max_expiration_ahead_s: records expiring further than this in the future are refused,
            in seconds (a record cannot squat a key for years).
    """

    initial_peers: Sequence[str] = ()
    bucket_size: int = 20
    alpha: int = 3
    num_replicas: int = 20
    refresh_interval_s: float = 600.0
    republish_interval_s: float = 1800.0
    cache_max_age_s: float = 30.0
    cache_max_entries: int = 1024
    replica_set_max_age_s: float = 60.0
    max_value_bytes: int = 64 * 1024
    max_records: int = 100_000
    max_storage_bytes: int = 256 * 2**20
    max_bytes_per_key: int = 2**20
    max_bytes_per_owner: int = 2**20
    max_unowned_bytes_per_key: int = 64 * 2**10
    max_unowned_bytes: int = 16 * 2**20
    lookup_timeout_s: float = 30.0
    max_nodes_per_answer: int = 40
    max_pending_verifications: int = 1024
    max_signature_checks: int = 8192
    max_signature_checks_per_peer: int = 256
    max_signature_checks_per_address: int = 1024
    max_signature_checks_per_s_per_peer: float = 1000.0
    max_signature_checks_per_s_per_address: float = 2000.0
    rpc_timeout_s: float = 5.0
    bootstrap_timeout_s: float = 10.0
    liveness_check_after_s: float = 60.0
    max_expiration_ahead_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, str):
            raise ConfigError("initial_peers must be a list of URLs, not one string")
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        object.__setattr__(self, "num_replicas", min(self.num_replicas, self.bucket_size))
        for url in self.initial_peers:
            try:
                parse_address(url, ("http", "https", "mem"))
            except BadMessageError as e:
                raise ConfigError(f"initial_peers: {url!r}: {e}") from None
        for name in (
            "bucket_size",
            "alpha",
            "num_replicas",
            "max_value_bytes",
            "max_records",
            "max_storage_bytes",
            "max_bytes_per_key",
            "max_bytes_per_owner",
            "max_unowned_bytes_per_key",
            "max_unowned_bytes",
            "max_nodes_per_answer",
            "max_pending_verifications",
            "max_signature_checks",
            "max_signature_checks_per_peer",
            "max_signature_checks_per_address",
            "max_signature_checks_per_s_per_peer",
            "max_signature_checks_per_s_per_address",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_nodes_per_answer < self.bucket_size:
            raise ConfigError(
                f"max_nodes_per_answer ({self.max_nodes_per_answer}) must be at least "
                f"bucket_size ({self.bucket_size})"
            )
        for name in (
            "refresh_interval_s",
            "republish_interval_s",
            "cache_max_age_s",
            "rpc_timeout_s",
            "bootstrap_timeout_s",
            "max_expiration_ahead_s",
            "lookup_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.replica_set_max_age_s >= 0:
            raise ConfigError(
                f"replica_set_max_age_s must be >= 0 seconds, got {self.replica_set_max_age_s}"
            )
        if self.cache_max_entries < 0:
            raise ConfigError(f"cache_max_entries must be >= 0, got {self.cache_max_entries}")
        if self.liveness_check_after_s < 0:
            raise ConfigError(
                f"liveness_check_after_s must be >= 0, got {self.liveness_check_after_s}"
            )
