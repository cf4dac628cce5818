"""The three DHT RPCs, both ends, and what every contact teaches the routing table.

Messages (msgpack maps; ids travel as 20 raw bytes, values as the writer's packed bytes):

* ``dht.ping``  ``{addr}`` -> ``{peer_id, addr}``
* ``dht.find``  ``{addr, key, value: bool}`` -> ``{peer_id, nodes: {peer_id: url}, entry}``
  where ``entry`` is None, ``["p", value, expiration]`` or
  ``["d", [[subkey, value, expiration, signature]...]]``
* ``dht.store`` ``{addr, records: [[key, subkey, value, expiration, signature]...]}`` ->
  ``{peer_id, accepted: [bool...], nodes}`` (nodes closest to the first record's key, so that
  stores double as the last round of a lookup); a record that fails validation refuses the
  whole request (422), one over ``max_value_bytes`` or malformed too (400).

``addr`` is the sender's URL (None for a client-mode node, which is never added to routing
tables). Every answer names the responder, so a node that took over a dead node's port is not
mistaken for it. A node that fails to answer is dropped from the routing table at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from dht.errors import BadMessageError, DHTError, RemoteError, TransportError, ValidationError
from dht.identity import is_peer_id, short_id
from dht.routing import DHTID, PeerInfo, RoutingTable
from dht.storage import DHTStorage, Entry, Record, Subkey
from dht.transport import RequestContext, Transport
from dht.validation import RecordValidator

logger = logging.getLogger(__name__)

PING, FIND, STORE = "dht.ping", "dht.find", "dht.store"
# Refusals that prove the remote is alive and a DHT node: it stays in the routing table.
_ALIVE_STATUSES = frozenset({400, 413, 422, 429})


@dataclass(frozen=True)
class StoreRequest:
    """One record to store under ``key_id`` (and ``subkey`` for a dictionary value)."""

    key_id: int
    subkey: Subkey | None
    record: Record


@dataclass(frozen=True)
class StoreAnswer:
    """A node's answer to ``dht.store``: which records it took, and its closest nodes."""

    accepted: list[bool]
    peers: list[PeerInfo]


@dataclass(frozen=True)
class FindAnswer:
    """A node's answer to ``dht.find``: its closest known nodes and what it holds."""

    peers: list[PeerInfo]
    entry: Entry | None


def encode_entry(entry: Entry | None) -> list | None:
    if entry is None:
        return None
    if isinstance(entry, Record):
        return ["p", entry.value_bytes, entry.expiration_time]
    return ["d", [[sk, r.value_bytes, r.expiration_time, r.signature] for sk, r in entry.items()]]


def decode_entry(obj: Any, max_value_bytes: int) -> Entry | None:
    """Parse an encoded entry; raises BadMessageError on anything malformed."""
    if obj is None:
        return None
    if not isinstance(obj, list) or len(obj) < 2:
        raise BadMessageError("entry must be a list")
    if obj[0] == "p" and len(obj) == 3:
        return _record(obj[1], obj[2], None, max_value_bytes)
    if obj[0] == "d" and len(obj) == 2 and isinstance(obj[1], list):
        entry: dict[Subkey, Record] = {}
        for item in obj[1]:
            if not isinstance(item, list) or len(item) != 4:
                raise BadMessageError("dictionary item must be [subkey, value, expiration, sig]")
            entry[_subkey(item[0])] = _record(item[1], item[2], item[3], max_value_bytes)
        return entry
    raise BadMessageError("entry kind must be 'p' or 'd'")


def _record(value: Any, expiration: Any, signature: Any, max_value_bytes: int) -> Record:
    if not isinstance(value, bytes):
        raise BadMessageError("value must be packed bytes")
    if len(value) > max_value_bytes:
        raise BadMessageError(f"value of {len(value)} bytes exceeds max_value_bytes")
    if isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise BadMessageError("expiration must be a number")
    if signature is not None and not isinstance(signature, bytes):
        raise BadMessageError("signature must be bytes")
    return Record(value, float(expiration), signature)


def _subkey(obj: Any) -> Subkey:
    if isinstance(obj, bool) or not isinstance(obj, str | bytes | int):
        raise BadMessageError("subkey must be str, bytes or int")
    return obj


def _key_id(obj: Any) -> DHTID:
    if not isinstance(obj, bytes):
        raise BadMessageError("key must be 20 bytes")
    try:
        return DHTID.from_raw(obj)
    except ValueError as e:
        raise BadMessageError(str(e)) from None


def decode_peers(obj: Any) -> list[PeerInfo]:
    if not isinstance(obj, dict):
        raise BadMessageError("nodes must be a map of peer_id to url")
    peers = []
    for peer_id, address in obj.items():
        if not (isinstance(peer_id, str) and isinstance(address, str)):
            raise BadMessageError("nodes must be a map of peer_id to url")
        peers.append(_peer_info(peer_id, address))
    return peers


@lru_cache(maxsize=65536)
def _peer_info(peer_id: str, address: str) -> PeerInfo:
    # Every find answer names up to k nodes, mostly the same ones: validate and hash each once.
    if not is_peer_id(peer_id):
        raise BadMessageError("node must be [peer_id, url]")
    return PeerInfo.of(peer_id, address)


def _field(payload: Any, name: str) -> Any:
    if not isinstance(payload, dict) or name not in payload:
        raise BadMessageError(f"message lacks field {name!r}")
    return payload[name]


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
    ):
        self.transport = transport
        self.own_id = own_id
        self.routing = routing
        self.storage = storage
        self.validator = validator
        self.bucket_size = bucket_size
        self.max_value_bytes = max_value_bytes
        self.rpc_timeout_s = rpc_timeout_s
        self.num_requests_sent = 0
        self._liveness_pings: dict[int, asyncio.Task] = {}
        self._closed = False
        transport.add_rpc_handler(PING, self._serve_ping)
        transport.add_rpc_handler(FIND, self._serve_find)
        transport.add_rpc_handler(STORE, self._serve_store)

    async def close(self) -> None:
        """Stop answering and cancel liveness pings in flight; safe to call twice."""
        self._closed = True
        tasks = list(self._liveness_pings.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- routing bookkeeping -----------------------------------------------------------------

    def note_contact(self, peer: PeerInfo) -> None:
        """``peer`` just talked to us or answered us: it is alive and worth knowing."""
        to_ping = self.routing.add_or_update(peer)
        if to_ping is None or self._closed or to_ping.node_id in self._liveness_pings:
            return
        task = asyncio.create_task(self._check_liveness(to_ping))
        self._liveness_pings[to_ping.node_id] = task
        task.add_done_callback(lambda _: self._liveness_pings.pop(to_ping.node_id, None))

    async def _check_liveness(self, peer: PeerInfo) -> None:
        # ping() marks the node alive or removes it (promoting the newcomer) by itself.
        await self.ping(peer.address, expected=peer)

    def _note_failure(self, peer: PeerInfo | None, error: TransportError) -> None:
        if isinstance(error, RemoteError) and error.status in _ALIVE_STATUSES:
            return
        if peer is not None and self.routing.remove(peer.node_id):
            logger.debug("dropped %s from routing: %s", short_id(peer.peer_id), error)

    async def _call(
        self, peer: PeerInfo | None, address: str, name: str, payload: dict, raises: bool = False
    ) -> Any:
        """Send one request; on failure drop ``peer`` and return None.

        With ``raises``, a refusal by a live node (a 4xx that proves it alive) is re-raised as
        :class:`RemoteError` instead; nothing else ever raises.
        """
        payload["addr"] = self.transport.address
        self.num_requests_sent += 1
        try:
            answer = await self.transport.call(address, name, payload, timeout_s=self.rpc_timeout_s)
            responder = _field(answer, "peer_id")
            if not is_peer_id(responder):
                raise BadMessageError("answer names no valid peer_id")
        except TransportError as e:
            logger.debug("%s to %s failed: %s", name, address, e)
            self._note_failure(peer, e)
            if raises and isinstance(e, RemoteError) and e.status in _ALIVE_STATUSES:
                raise
            return None
        except DHTError as e:  # a malformed or unauthenticated answer: as good as none
            logger.debug("%s to %s answered unusably: %s", name, address, e)
            self._note_failure(peer, TransportError(str(e)))
            return None
        if peer is not None and responder != peer.peer_id:
            logger.debug("%s at %s is now %s", short_id(peer.peer_id), address, short_id(responder))
            self._note_failure(peer, TransportError("another node answers at this address"))
        self.note_contact(PeerInfo.of(responder, address))
        if peer is not None and responder != peer.peer_id:
            return None
        return answer

    # ---- client side -------------------------------------------------------------------------

    async def ping(self, address: str, expected: PeerInfo | None = None) -> PeerInfo | None:
        """Ping a node (``expected`` if known); returns who answered, or None."""
        answer = await self._call(expected, address, PING, {})
        if answer is None:
            return None
        return PeerInfo.of(answer["peer_id"], address)

    async def find(self, peer: PeerInfo, key_id: int, *, want_value: bool) -> FindAnswer | None:
        """Ask ``peer`` for its closest nodes to ``key_id`` (and its value); None if it failed."""
        payload = {"key": DHTID(key_id).to_raw(), "value": want_value}
        answer = await self._call(peer, peer.address, FIND, payload)
        if answer is None:
            return None
        try:
            peers = decode_peers(_field(answer, "nodes"))
            entry = decode_entry(answer.get("entry"), self.max_value_bytes) if want_value else None
        except BadMessageError as e:
            logger.debug("find answer of %s malformed: %s", short_id(peer.peer_id), e)
            self._note_failure(peer, TransportError(str(e)))
            return None
        return FindAnswer(peers, self._drop_invalid(key_id, entry, peer))

    def _drop_invalid(self, key_id: int, entry: Entry | None, source: PeerInfo) -> Entry | None:
        """A reader trusts no replica: re-validate what came back, keep only what passes."""
        if entry is None:
            return None
        items = [(None, entry)] if isinstance(entry, Record) else list(entry.items())
        valid: dict[Subkey | None, Record] = {}
        for subkey, record in items:
            try:
                self.validator.validate(key_id, subkey, record)
            except ValidationError as e:
                logger.warning("invalid record from %s ignored: %s", short_id(source.peer_id), e)
                continue
            valid[subkey] = record
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
            answer = await self._call(peer, peer.address, STORE, {"records": records}, raises=True)
        except RemoteError:
            return StoreAnswer([False] * len(requests), [])
        if answer is None:
            return None
        accepted = answer.get("accepted")
        try:
            peers = decode_peers(answer.get("nodes", {}))
        except BadMessageError:
            peers = []
        if not isinstance(accepted, list) or len(accepted) != len(requests):
            return StoreAnswer([False] * len(requests), peers)
        return StoreAnswer([flag is True for flag in accepted], peers)

    # ---- server side -------------------------------------------------------------------------

    def _note_sender(self, ctx: RequestContext, payload: Any) -> None:
        if self._closed:
            raise DHTError("this DHT node is closed")
        address = payload.get("addr") if isinstance(payload, dict) else None
        if isinstance(address, str) and address and is_peer_id(ctx.sender):
            self.note_contact(PeerInfo.of(ctx.sender, address))

    def _answer(self, **fields: Any) -> dict:
        return {"peer_id": self.transport.peer_id, **fields}

    async def _serve_ping(self, ctx: RequestContext, payload: Any) -> dict:
        self._note_sender(ctx, payload)
        return self._answer(addr=self.transport.address)

    async def _serve_find(self, ctx: RequestContext, payload: Any) -> dict:
        key_id = _key_id(_field(payload, "key"))
        self._note_sender(ctx, payload)
        entry = self.storage.get(key_id) if payload.get("value") else None
        return self._answer(nodes=self._nearest(key_id, ctx), entry=encode_entry(entry))

    async def _serve_store(self, ctx: RequestContext, payload: Any) -> dict:
        raw_records = _field(payload, "records")
        if not isinstance(raw_records, list):
            raise BadMessageError("records must be a list")
        requests = [self._parse_store(item) for item in raw_records]
        for r in requests:
            self.validator.validate(r.key_id, r.subkey, r.record)  # refuses all: 422
        self._note_sender(ctx, payload)
        accepted = [self.storage.store(r.key_id, r.record, r.subkey) for r in requests]
        nearest = self._nearest(requests[0].key_id, ctx) if requests else []
        return self._answer(accepted=accepted, nodes=nearest)

    def _nearest(self, key_id: int, ctx: RequestContext) -> dict[str, str]:
        sender_id = DHTID.from_peer_id(ctx.sender) if is_peer_id(ctx.sender) else None
        nearest = self.routing.nearest(key_id, self.bucket_size, exclude=sender_id)
        return {p.peer_id: p.address for p in nearest}

    def _parse_store(self, item: Any) -> StoreRequest:
        if not isinstance(item, list) or len(item) != 5:
            raise BadMessageError("record must be [key, subkey, value, expiration, signature]")
        key_id = _key_id(item[0])
        subkey = None if item[1] is None else _subkey(item[1])
        return StoreRequest(
            key_id, subkey, _record(item[2], item[3], item[4], self.max_value_bytes)
        )
