"""A Kademlia DHT node: store and get values, replicated on the k closest nodes.

Usage (handlers are registered in the constructor, so build the node before starting the
transport)::

    transport = HttpTransport(identity, TransportConfig())
    node = DHTNode(transport=transport, identity=identity, config=DHTConfig(initial_peers=urls))
    async with transport, node:
        await node.store("key", {"any": "msgpack"}, get_dht_time() + 60)
        found = await node.get("key")

Network failures never raise out of :meth:`DHTNode.store` and :meth:`DHTNode.get`: they return
False / None (the outcome methods say why). A node whose transport has no address (client mode)
answers nothing and holds nothing, but stores and gets through the others.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dht.errors import TransportError
from dht.identity import PeerIdentity, short_id
from dht.kademlia.config import Clock, DHTConfig, SystemClock, get_dht_time
from dht.kademlia.lookup import LookupResult, iterative_find
from dht.kademlia.maintenance import Maintenance
from dht.kademlia.messages import FindAnswer, StoreRequest
from dht.kademlia.outcomes import GetOutcome, Replication, StoreOutcome
from dht.kademlia.protocol import DHTProtocol
from dht.kademlia.replica_sets import ReplicaSets
from dht.kademlia.routing import DHTID, PeerInfo, RoutingTable
from dht.kademlia.storage import (
    DHTStorage,
    Entry,
    Subkey,
    ValueWithExpiration,
    decode_entry,
    merge_entries,
)
from dht.kademlia.validation import OwnerSignatureValidator, RecordValidator, make_record
from dht.kademlia.value_cache import ValueCache
from dht.net.fair_work import FairWork
from dht.net.transport import Transport
from dht.net.wire import MessageLimits

logger = logging.getLogger(__name__)

__all__ = ["DHTConfig", "DHTNode", "GetOutcome", "StoreOutcome", "ValueWithExpiration",
           "get_dht_time"]  # fmt: skip

Key = str | bytes
_BOOTSTRAP_RETRY_S = 0.25  # pause between rounds of pings to initial peers that did not answer


class DHTNode:
    """One node of the DHT.

    Args:
        transport: the network; not yet started (this constructor adds the RPC handlers).
        identity: this node's key pair; it signs the records under its owner subkey.
        config: bootstrap peers, k, alpha, replication, intervals, limits and timeouts.
        clock: the wall clock expirations are measured on (a simulation passes its own).
        validator: checks records on store and on read (default: owner subkeys signed).
        limits: bounds on decoding values read from the network.
    """

    def __init__(
        self,
        *,
        transport: Transport,
        identity: PeerIdentity,
        config: DHTConfig,
        clock: Clock | None = None,
        validator: RecordValidator | None = None,
        limits: MessageLimits | None = None,
    ):
        if transport.peer_id != identity.peer_id:
            raise ValueError("the transport and the DHT node must share one identity")
        self.config = config
        self.identity = identity
        self.transport = transport
        self.clock = clock or SystemClock()
        self.node_id = DHTID.from_peer_id(identity.peer_id)
        self.limits = limits or MessageLimits()
        self.routing = RoutingTable(self.node_id, config.bucket_size, config.liveness_check_after_s)
        self.storage = DHTStorage(
            self.clock,
            config.max_records,
            max_expiration_ahead_s=config.max_expiration_ahead_s,
            max_bytes=config.max_storage_bytes,
            max_bytes_per_key=config.max_bytes_per_key,
            max_bytes_per_owner=config.max_bytes_per_owner,
            max_unowned_bytes_per_key=config.max_unowned_bytes_per_key,
            max_unowned_bytes=config.max_unowned_bytes,
        )
        self.cache = ValueCache(config.cache_max_entries, config.cache_max_age_s)
        self.replica_sets = ReplicaSets(config.replica_set_max_age_s)
        self.validator = validator or OwnerSignatureValidator()
        self.protocol = DHTProtocol(
            transport,
            own_id=self.node_id,
            routing=self.routing,
            storage=self.storage,
            validator=self.validator,
            bucket_size=config.bucket_size,
            max_value_bytes=config.max_value_bytes,
            rpc_timeout_s=config.rpc_timeout_s,
            max_nodes_per_answer=config.max_nodes_per_answer,
            max_pending_verifications=config.max_pending_verifications,
            signature_work=FairWork(
                max_units=config.max_signature_checks,
                max_units_per_peer=config.max_signature_checks_per_peer,
                max_units_per_address=config.max_signature_checks_per_address,
                unit="signatures to check",
                max_units_per_s_per_peer=config.max_signature_checks_per_s_per_peer,
                max_units_per_s_per_address=config.max_signature_checks_per_s_per_address,
            ),
        )
        self.maintenance = Maintenance(self)
        self._started = False
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def address(self) -> str | None:
        """This node's URL, or None in client mode."""
        return self.transport.address

    @property
    def num_known_peers(self) -> int:
        """Nodes in the routing table."""
        return len(self.routing)

    def __repr__(self) -> str:
        return f"DHTNode({short_id(self.peer_id)}, {self.address})"

    async def start(self) -> None:
        """Bootstrap from ``config.initial_peers`` and start refresh and republish.

        Call after the transport started (so this node knows its own address).

        Raises:
            TransportError: initial peers were given and none of them answered in time.
        """
        if self._started:
            return
        self._started = True
        if self.config.initial_peers:
            await self.bootstrap(self.config.initial_peers)
        self.maintenance.start()

    async def bootstrap(self, urls) -> int:
        """Ping ``urls``, then look up the own id to meet the neighbours; returns peers reached.

        Pings are retried (a packet lost, a peer still starting) until ``bootstrap_timeout_s``.

        Raises:
            TransportError: none of the URLs answered within ``bootstrap_timeout_s``.
        """
        own = self.address
        urls = [url for url in urls if url != own]
        num_reached = 0
        try:
            async with asyncio.timeout(self.config.bootstrap_timeout_s):
                while urls and not num_reached:
                    answers = await asyncio.gather(*(self.protocol.ping(url) for url in urls))
                    num_reached = sum(answer is not None for answer in answers)
                    if not num_reached:
                        await asyncio.sleep(_BOOTSTRAP_RETRY_S)
        except TimeoutError:
            pass
        if urls and not num_reached:
            raise TransportError(f"none of the initial peers answered: {', '.join(urls)}")
        await self.lookup(self.node_id, want_value=False)
        logger.debug("%r bootstrapped: %d peers known", self, self.num_known_peers)
        return num_reached

    async def close(self) -> None:
        """Stop maintenance and liveness pings (the transport is the caller's); safe twice."""
        if self._closed:
            return
        self._closed = True
        await self.maintenance.close()
        await self.protocol.close()

    async def __aenter__(self) -> DHTNode:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- lookups -----------------------------------------------------------------------------

    async def lookup(
        self,
        target: int,
        *,
        want_value: bool,
        latest: bool = True,
        converge_on: int | None = None,
        timeout_s: float | None = None,
    ) -> LookupResult:
        """An iterative lookup of ``target`` over the network (the own storage is not read),
        bounded by ``timeout_s`` (at most ``lookup_timeout_s``; None: that)."""
        k = self.config.bucket_size
        bound_s = self.config.lookup_timeout_s
        if timeout_s is not None:
            bound_s = min(bound_s, timeout_s)
        if want_value and latest and converge_on is None:
            # the replicas are the num_replicas closest: asking farther nodes for the value
            # moved a copy per node asked (20 with k) for records that live on 5
            converge_on = self.config.num_replicas
        return await iterative_find(
            target,
            self.routing.nearest(target, k),
            lambda peer: self.protocol.find(peer, target, want_value=want_value),
            own_id=self.node_id,
            k=k,
            alpha=self.config.alpha,
            stop_on_value=want_value and not latest,
            converge_on=converge_on,
            timeout_s=bound_s,
        )

    def _is_replica(self, key_id: int, others: list[PeerInfo], num_replicas: int) -> bool:
        """Whether this node is among the ``num_replicas`` closest to ``key_id``."""
        if self.address is None:
            return False
        own_distance = self.node_id ^ key_id
        num_closer = sum(1 for p in others if p.node_id ^ key_id < own_distance)
        return num_closer < num_replicas

    def _num_replicas(self, replicas: int | None) -> int:
        """A caller's count of replicas (None: ``num_replicas``), at most ``num_replicas``."""
        if replicas is None:
            return self.config.num_replicas
        return max(1, min(int(replicas), self.config.num_replicas))

    async def replicate(
        self,
        key_id: int,
        requests: list[StoreRequest],
        replicas: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Replication:
        """Store records (all under ``key_id``) on the ``replicas`` closest nodes (None:
        ``num_replicas``).

        Finds run until the ``alpha`` closest nodes answered (none when the nodes that took
        the key's last store are remembered: :mod:`dht.kademlia.replica_sets`); then stores go
        to all of the closest seen at once, and their answers, which name closer nodes if there
        are any, carry the lookup on until the closest have all answered a store. With
        ``timeout_s`` the finds take at most half of it and the stores the rest; at the bound,
        the replicas that accepted by then count.
        """
        num_replicas = self._num_replicas(replicas)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        candidates, hops = await self._store_candidates(
            key_id, timeout_s=None if timeout_s is None else timeout_s / 2
        )
        here = self._is_replica(key_id, candidates, num_replicas)
        num_remote = num_replicas - here
        accepted_by: dict[int, bool] = {}

        async def store_on(peer: PeerInfo) -> FindAnswer | None:
            answer = await self.protocol.store(peer, requests)
            if answer is None:
                return None
            accepted_by[peer.node_id] = any(answer.accepted)
            return FindAnswer(answer.peers, None)

        closest: list[PeerInfo] = []
        if num_remote > 0:
            stored = await iterative_find(
                key_id,
                candidates,
                store_on,
                own_id=self.node_id,
                k=num_remote,
                alpha=num_remote,
                stop_on_value=False,
                timeout_s=self.config.lookup_timeout_s
                if deadline is None
                else max(0.0, min(self.config.lookup_timeout_s, deadline - loop.time())),
            )
            closest = stored.nearest
            if len(closest) == num_remote and not stored.timed_out:
                self.replica_sets.put(key_id, closest)  # those that answered: a node that
                # left was passed over for the next closest, as in a lookup
            else:  # too few answered: look the key up next time
                self.replica_sets.forget(key_id)
        num_accepted = sum(accepted_by.get(p.node_id, False) for p in closest)
        # Candidates may name dead nodes; who answered the stores settles whether we are needed.
        here = here or self._is_replica(key_id, closest, num_replicas)
        if here:
            local = [self.storage.store(r.key_id, r.record, r.subkey) for r in requests]
            num_accepted += any(local)
        return Replication(num_accepted, len(closest) + here, hops)

    async def _store_candidates(
        self, key_id: int, *, timeout_s: float | None = None
    ) -> tuple[list[PeerInfo], int]:
        """Where a store of ``key_id`` starts, and the lookup's depth: the nodes that took its
        last store and the own closest known (no lookup; see :mod:`dht.kademlia.replica_sets`),
        else a lookup's closest candidates (those known at ``timeout_s``, if it runs out)."""
        k = self.config.bucket_size
        seeds = self.replica_sets.seeds(key_id, self.routing.nearest(key_id, k), k)
        if seeds is not None:
            return seeds, 1
        found = await self.lookup(
            key_id, want_value=False, converge_on=self.config.alpha, timeout_s=timeout_s
        )
        return found.candidates, found.hops

    # ---- store -------------------------------------------------------------------------------

    async def store(
        self,
        key: Key,
        value: Any,
        expiration_time: float,
        subkey: Subkey | None = None,
        *,
        replicas: int | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Store ``value`` (anything msgpack can pack) under ``key`` until ``expiration_time``.

        With ``subkey`` the key holds a dictionary and this sets one of its entries; under this
        node's :func:`dht.kademlia.validation.owner_subkey` the record is signed automatically.
        With ``replicas``, the value goes to that many closest nodes (at most ``num_replicas``;
        None: all of them): a record rewritten every few seconds and read from the closest few
        (``get(..., replicas=)``) needs no more, and each one less is one request less.
        With ``timeout_s`` the store ends within about that many seconds, and the replicas that
        accepted by then count: a bound around the call instead would throw their answers away
        (on a busy host, where one slow replica holds up the store, the value is then stored
        and reported lost).

        Returns:
            True if at least one replica accepted the value.

        Raises:
            BadMessageError: the value cannot be packed or exceeds ``max_value_bytes``.
        """
        outcome = await self.store_outcome(
            key, value, expiration_time, subkey, replicas=replicas, timeout_s=timeout_s
        )
        return outcome.ok

    async def store_outcome(
        self,
        key: Key,
        value: Any,
        expiration_time: float,
        subkey: Subkey | None = None,
        *,
        replicas: int | None = None,
        timeout_s: float | None = None,
    ) -> StoreOutcome:
        """Like :meth:`store`, with the number of replicas that accepted and why not."""
        key_id = DHTID.from_key(key)
        record = make_record(
            key_id,
            value,
            expiration_time,
            subkey,
            identity=self.identity,
            config=self.config,
            now=self.clock.time(),
        )
        if isinstance(record, str):
            logger.warning("store of %r refused here: %s", key, record)
            return StoreOutcome(False, 0, 0, 0, record)
        self.cache.invalidate(key_id)
        done = await self.replicate(
            key_id, [StoreRequest(key_id, subkey, record)], replicas, timeout_s=timeout_s
        )
        if done.num_accepted:
            return StoreOutcome(True, done.num_accepted, done.num_replicas, done.hops)
        reason = "no replica found" if not done.num_replicas else "every replica refused or failed"
        logger.warning("store of %r failed: %s (%d replicas)", key, reason, done.num_replicas)
        return StoreOutcome(False, 0, done.num_replicas, done.hops, reason)

    # ---- get ---------------------------------------------------------------------------------

    async def get(
        self,
        key: Key,
        latest: bool = False,
        *,
        fresh: bool = False,
        replicas: int | None = None,
        timeout_s: float | None = None,
    ) -> ValueWithExpiration | None:
        """The value under ``key``, or None if there is none (or the network failed).

        For a dictionary key the value is ``{subkey: ValueWithExpiration}``, with the
        expiration of its newest subkey.

        Args:
            key: the key (str or bytes).
            latest: ask the ``num_replicas`` closest nodes (those every store goes to) and
                merge their answers with what the nodes on the way held (every subkey any of
                them holds, the newest version of each). Without it the answer may come from a read
                of the last ``cache_max_age_s``, from this node's own replica, or from the first
                node of the lookup that holds the key: cheaper, and complete as long as that
                replica saw every store (a replica that joined late may lack older subkeys
                until they are republished).
            fresh: without ``latest``, never answer from the read cache: one replica's
                current value (this node's own, or the first found by a lookup), for a
                value that changes every few seconds and is read as a sample (one copy
                moves, not one per replica).
            replicas: with ``latest``, merge only this many closest replicas (at most
                ``num_replicas``; None: all of them): each one merged is one more copy moved.
            timeout_s: bound on the lookup, in seconds (None: ``lookup_timeout_s``); at the
                bound the value is what the nodes that answered by then hold, merged. For a
                reader whose wait is shorter than a lookup may take on a busy network: a
                bound around the call instead loses the answers that did come.
        """
        outcome = await self.get_outcome(
            key, latest=latest, fresh=fresh, replicas=replicas, timeout_s=timeout_s
        )
        return outcome.value

    async def get_outcome(
        self,
        key: Key,
        *,
        latest: bool = False,
        fresh: bool = False,
        replicas: int | None = None,
        timeout_s: float | None = None,
    ) -> GetOutcome:
        """Like :meth:`get`, with where the value came from and the lookup's depth."""
        key_id = DHTID.from_key(key)
        now = self.clock.time()
        if not latest:
            cached = None if fresh else self.cache.get(key_id, now)
            for source, entry in (("cache", cached), ("local", self.storage.get(key_id))):
                value = self._decode(entry, key)
                if value is not None:
                    return GetOutcome(value, source)  # type: ignore[arg-type]
        converge_on = None
        if latest and replicas is not None:
            converge_on = self._num_replicas(replicas)
        found = await self.lookup(
            key_id, want_value=True, latest=latest, converge_on=converge_on, timeout_s=timeout_s
        )
        entry = found.entry
        if latest:
            entry = merge_entries(entry, self.storage.get(key_id))
        value = self._decode(entry, key)
        if value is None:
            reason = "not found"
            if found.num_queried and found.num_failed == found.num_queried:
                reason = "no node answered"
            elif not found.num_queried and self.address is None:
                reason = "no known peers"
            elif found.timed_out and not found.nearest:
                reason = "no node answered in time"
            # the bound is the caller's (a busy network, not a broken one): its caller says
            # what it missed
            if reason not in ("not found", "no node answered in time"):
                logger.warning("get of %r failed: %s", key, reason)
            return GetOutcome(
                None, "none", found.hops, found.num_queried, reason, len(found.nearest)
            )
        self.cache.put(key_id, entry)  # type: ignore[arg-type]
        return GetOutcome(
            value, "network", found.hops, found.num_queried, num_answered=len(found.nearest)
        )

    def _decode(self, entry: Entry | None, key: Key) -> ValueWithExpiration | None:
        return decode_entry(entry, self.limits, self.clock.time(), key)
