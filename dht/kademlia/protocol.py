"""The three DHT RPCs, both ends, and what every contact teaches the routing table.

The messages and their wire forms are in :mod:`dht.kademlia.messages`. The transport proves who
sent a request and who answered one; the ``peer_id`` an answer names must be that proven peer.
An address is a claim until proven: a node enters the routing table only with an address at
which it answered a request from this node (a sender's claimed address is pinged back first).
A node that fails to answer is dropped at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dht.errors import (
    BadMessageError,
    DHTError,
    RemoteError,
    TransportError,
    WrongPeerError,
)
from dht.identity import is_peer_id, short_id
from dht.kademlia.messages import (
    FindAnswer,
    StoreAnswer,
    StoreRequest,
    checked_value,
    decode_entry,
    decode_peers,
    encode_entry,
    same_host,
)
from dht.kademlia.record_checks import RecordChecker
from dht.kademlia.routing import DHTID, PeerInfo, RoutingTable
from dht.kademlia.storage import DHTStorage, Entry, Record
from dht.kademlia.validation import RecordValidator
from dht.net import schema
from dht.net.fair_work import FairWork
from dht.net.transport import RequestContext, Transport

logger = logging.getLogger(__name__)

PING, FIND, STORE = "dht.ping", "dht.find", "dht.store"
# Refusals that prove the remote is alive and a DHT node: it stays in the routing table.
_ALIVE_STATUSES = frozenset({400, 413, 422, 429, 503})


class DHTProtocol:
    """Serves and sends the DHT RPCs for one node, keeping its routing table current.

    Args:
        transport: the network; handlers are added here, so construct before it starts.
        own_id: this node's id.
        routing: the routing table every contact updates.
        storage: the records served and stored.
        validator: checks records before they are stored and after they are read.
        bucket_size: how many nodes a find answers with.
        max_value_bytes: the largest value accepted.
        rpc_timeout_s: bound on each outgoing request, in seconds.
        max_nodes_per_answer: answers naming more nodes than this are refused whole.
        max_pending_verifications: claimed sender addresses being pinged back at once, at
            most (a flood of strangers must not make this node flood others).
        max_records_per_answer: answers carrying more records than this are refused whole.
        signature_work: the queue that checks records' signatures off the event loop, fairly
            (closed with this protocol); None checks them in worker threads with no shares.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        own_id: DHTID,
        routing: RoutingTable,
        storage: DHTStorage,
        validator: RecordValidator,
        bucket_size: int,
        max_value_bytes: int,
        rpc_timeout_s: float,
        max_nodes_per_answer: int = 40,
        max_pending_verifications: int = 1024,
        max_records_per_answer: int = 8192,
        signature_work: FairWork | None = None,
    ):
        self.transport = transport
        self.own_id = own_id
        self.routing = routing
        self.storage = storage
        self.validator = validator
        self.signature_work = signature_work
        self.checker = RecordChecker(
            validator, max_records_per_answer=max_records_per_answer, work=signature_work
        )
        self.bucket_size = bucket_size
        self.max_value_bytes = max_value_bytes
        self.rpc_timeout_s = rpc_timeout_s
        self.max_nodes_per_answer = max_nodes_per_answer
        self.max_pending_verifications = max_pending_verifications
        self.schemes: tuple[str, ...] = getattr(transport, "address_schemes", schema.HTTP_SCHEMES)
        self.num_requests_sent = 0
        self.num_bad_answers = 0
        self._liveness_pings: dict[int, asyncio.Task] = {}
        self._verifications: dict[int, asyncio.Task] = {}
        self._closed = False
        transport.add_rpc_handler(PING, self._serve_ping)
        transport.add_rpc_handler(FIND, self._serve_find)
        transport.add_rpc_handler(STORE, self._serve_store)

    async def close(self) -> None:
        """Stop answering and cancel pings in flight; safe to call twice."""
        self._closed = True
        tasks = [*self._liveness_pings.values(), *self._verifications.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.signature_work is not None:
            await self.signature_work.close()

    # ---- routing bookkeeping -----------------------------------------------------------------

    def note_contact(self, peer: PeerInfo) -> None:
        """``peer`` just answered us at its address: it is alive and worth knowing."""
        to_ping = self.routing.add_or_update(peer)
        if to_ping is None or self._closed or to_ping.node_id in self._liveness_pings:
            return
        task = asyncio.create_task(self._check_liveness(to_ping))
        self._liveness_pings[to_ping.node_id] = task
        task.add_done_callback(lambda _: self._liveness_pings.pop(to_ping.node_id, None))

    async def _check_liveness(self, peer: PeerInfo) -> None:
        # ping() marks the node alive or removes it (promoting the newcomer) by itself.
        await self.ping(peer.address, expected=peer)

    def _note_claimed(self, sender: str, address: str, remote_host: str) -> None:
        """A proven ``sender`` says it serves at ``address``: believed when it is known there
        already or the address is on the host the request came from; otherwise pinged back
        there (expecting that very peer) before it enters the routing table."""
        peer = PeerInfo.of(sender, address)
        known = self.routing.get(peer.node_id)
        if known is not None and known.address == address:
            self.note_contact(known)
            return
        if remote_host and same_host(address, remote_host):
            # A sender can only point its own id at its own host: nothing to verify there.
            self.note_contact(peer)
            return
        if (
            self._closed
            or peer.node_id in self._verifications
            or len(self._verifications) >= self.max_pending_verifications
        ):
            return
        task = asyncio.create_task(self.ping(address, expected=peer))
        self._verifications[peer.node_id] = task
        task.add_done_callback(lambda _: self._verifications.pop(peer.node_id, None))

    def _note_failure(self, peer: PeerInfo | None, error: TransportError) -> None:
        if isinstance(error, RemoteError) and error.status in _ALIVE_STATUSES:
            return
        if peer is not None and self.routing.remove(peer.node_id):
            logger.debug("dropped %s from routing: %s", short_id(peer.peer_id), error)

    async def _call(
        self,
        peer: PeerInfo | None,
        address: str,
        name: str,
        payload: dict,
        model: type,
        raises: bool = False,
    ) -> Any:
        """Send one request and parse the answer as ``model``; on failure drop ``peer`` and
        return None.

        With ``raises``, a refusal by a live node (a 4xx that proves it alive) is re-raised as
        :class:`RemoteError` instead; nothing else ever raises.
        """
        payload["addr"] = self.transport.address
        self.num_requests_sent += 1
        expected = peer.peer_id if peer is not None else None
        try:
            raw = await self.transport.call(
                address, name, payload, timeout_s=self.rpc_timeout_s, expected_peer=expected
            )
            answer = schema.parse(
                model,
                raw,
                max_nodes=self.max_nodes_per_answer,
                max_entry_records=self.checker.max_records_per_answer,
            )
            if answer.peer_id != (expected or self.transport.peer_at(address)):
                raise BadMessageError("the answer names another peer than the one that sent it")
        except WrongPeerError as e:
            # Another node took over that address and proved it: forget the old, meet the new.
            logger.debug("%s: %s", name, e)
            self._note_failure(peer, e)
            self.note_contact(PeerInfo.of(e.actual, address))
            return None
        except TransportError as e:
            logger.debug("%s to %s failed: %s", name, address, e)
            self._note_failure(peer, e)
            if raises and isinstance(e, RemoteError) and e.status in _ALIVE_STATUSES:
                raise
            return None
        except DHTError as e:  # a malformed answer: as good as none
            self.num_bad_answers += 1
            logger.debug("%s to %s answered unusably: %s", name, address, e)
            self._note_failure(peer, TransportError(str(e)))
            return None
        self.note_contact(PeerInfo.of(answer.peer_id, address))
        return answer

    # ---- client side -------------------------------------------------------------------------

    async def ping(self, address: str, expected: PeerInfo | None = None) -> PeerInfo | None:
        """Ping a node (``expected`` if known); returns who answered (proven), or None."""
        answer = await self._call(expected, address, PING, {}, schema.PingAnswer)
        if answer is None:
            return None
        return PeerInfo.of(answer.peer_id, address)

    async def find(self, peer: PeerInfo, key_id: int, *, want_value: bool) -> FindAnswer | None:
        """Ask ``peer`` for its closest nodes to ``key_id`` (and its value); None if it failed."""
        payload = {"key": DHTID(key_id).to_raw(), "value": want_value}
        answer = await self._call(peer, peer.address, FIND, payload, schema.FindAnswer)
        if answer is None:
            return None
        try:
            peers = decode_peers(answer.nodes, self.schemes)
            entry = decode_entry(answer.entry, self.max_value_bytes) if want_value else None
        except BadMessageError as e:
            self.num_bad_answers += 1
            logger.debug("find answer of %s malformed: %s", short_id(peer.peer_id), e)
            self._note_failure(peer, TransportError(str(e)))
            return None
        return FindAnswer(peers, await self._drop_invalid(key_id, entry, peer))

    async def _drop_invalid(
        self, key_id: int, entry: Entry | None, source: PeerInfo
    ) -> Entry | None:
        """A reader trusts no replica: re-validate what came back, keep only what passes
        (bounded work per answer: :mod:`dht.kademlia.record_checks`)."""
        if entry is None:
            return None
        items = [(None, entry)] if isinstance(entry, Record) else list(entry.items())
        if self.checker.too_many(len(items)):
            self.num_bad_answers += 1
            return None
        valid = await self.checker.valid_records(
            key_id, items, short_id(source.peer_id), source.peer_id
        )
        if isinstance(entry, Record):
            return valid.get(None)
        return valid or None  # type: ignore[return-value]

    async def store(self, peer: PeerInfo, requests: list[StoreRequest]) -> StoreAnswer | None:
        """Send records to ``peer``: which it accepted, and its closest nodes to the first key.

        Returns:
            None if the node failed; all False if it refused the records (422, 400).
        """
        records = [
            [DHTID(r.key_id).to_raw(), r.subkey, r.record.value_bytes,
             r.record.expiration_time, r.record.signature]
            for r in requests
        ]  # fmt: skip
        try:
            answer = await self._call(
                peer, peer.address, STORE, {"records": records}, schema.StoreAnswer, raises=True
            )
        except RemoteError:
            return StoreAnswer([False] * len(requests), [])
        if answer is None:
            return None
        try:
            peers = decode_peers(answer.nodes, self.schemes)
        except BadMessageError:
            peers = []
        if len(answer.accepted) != len(requests):
            return StoreAnswer([False] * len(requests), peers)
        return StoreAnswer(answer.accepted, peers)

    # ---- server side -------------------------------------------------------------------------

    def _parse_request(self, model: type, ctx: RequestContext, payload: Any):
        if self._closed:
            raise DHTError("this DHT node is closed")
        request = schema.parse(model, payload)
        if request.addr is not None:
            try:
                schema.parse_address(request.addr, self.schemes)
            except BadMessageError:
                request = request.model_copy(update={"addr": None})  # unusable: ignore it
        return request

    def _note_sender(self, ctx: RequestContext, request: Any) -> None:
        if request.addr and is_peer_id(ctx.sender):
            self._note_claimed(ctx.sender, request.addr, ctx.remote_host)

    def _answer(self, **fields: Any) -> dict:
        return {"peer_id": self.transport.peer_id, **fields}

    async def _serve_ping(self, ctx: RequestContext, payload: Any) -> dict:
        request = self._parse_request(schema.PingRequest, ctx, payload)
        self._note_sender(ctx, request)
        return self._answer(addr=self.transport.address)

    async def _serve_find(self, ctx: RequestContext, payload: Any) -> dict:
        request = self._parse_request(schema.FindRequest, ctx, payload)
        key_id = DHTID.from_raw(request.key)
        self._note_sender(ctx, request)
        entry = self.storage.get(key_id) if request.value else None
        return self._answer(nodes=self._nearest(key_id, ctx), entry=encode_entry(entry))

    async def _serve_store(self, ctx: RequestContext, payload: Any) -> dict:
        self.checker.refuse_if_full(ctx.sender, ctx.remote_host)
        request = self._parse_request(schema.StoreRequest, ctx, payload)
        requests = [
            StoreRequest(
                DHTID.from_raw(key), subkey,
                Record(checked_value(value, self.max_value_bytes), expiration, signature),
            )
            for key, subkey, value, expiration, signature in request.records
        ]  # fmt: skip
        # refuses all: 422 (a record fails), 429 (the sender's share of the checks is in use)
        await self.checker.check_store(
            [(r.key_id, r.subkey, r.record) for r in requests], ctx.sender, ctx.remote_host
        )
        self._note_sender(ctx, request)
        accepted = [self.storage.store(r.key_id, r.record, r.subkey) for r in requests]
        nearest = self._nearest(requests[0].key_id, ctx) if requests else {}
        return self._answer(accepted=accepted, nodes=nearest)

    def _nearest(self, key_id: int, ctx: RequestContext) -> dict[str, str]:
        sender_id = DHTID.from_peer_id(ctx.sender) if is_peer_id(ctx.sender) else None
        nearest = self.routing.nearest(key_id, self.bucket_size, exclude=sender_id)
        return {p.peer_id: p.address for p in nearest}
