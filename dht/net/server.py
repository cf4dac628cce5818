"""The node's side of the aiohttp transport: handshakes, RPCs and streams, proven and bounded.

The order of checks spends as little as possible on a stranger: a connection over the caps (or
its address's share of new connections) is closed before it is parsed
(:class:`dht.net.limits.ConnectionGate`); a request passes the door (:mod:`dht.net.door`: its
address's and its proven peer's shares of requests, its session ticket, MAC, timestamp and nonce,
all from headers) before a byte of its body is read; a ``Content-Length`` over the limit is
refused at once (413); bodies are read only within a budget of bytes in flight, shared per peer
and per address, and their digest must match the one the MAC covered. Every refusal is a 4xx/5xx
with a reason (see :class:`dht.net.door.Door`); the node keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web

from dht.errors import AuthError, BadMessageError, DHTError, RemoteError, TransportError
from dht.identity import PeerIdentity
from dht.net.auth import FrameTagger, SwarmAuth
from dht.net.client import (
    API_VERSION,
    HELLO_HEADER,
    HELLO_REPLY_HEADER,
    MAX_HELLO_BYTES,
    MSGPACK,
    decode_hello_header,
    encode_hello_header,
)
from dht.net.config import TransportConfig
from dht.net.door import Door, Proven, printable_ascii, refuse_over_rate
from dht.net.frames import FrameReader
from dht.net.limits import ConnectionGate, OverBudget, StreamSlots
from dht.net.refusals import ClientGone, Refused, read_charged, status_of
from dht.net.session import (
    FirstRequest,
    HelloReply,
    HelloRequest,
    digest,
    response_mac,
)
from dht.net.session_issuer import SessionIssuer
from dht.net.shares import FairBudget, OverShare
from dht.net.streams import ServerStream
from dht.net.transport import ByteCounters, RequestContext, RpcHandler, StreamHandler
from dht.net.wire import pack, unpack

logger = logging.getLogger(__name__)
__all__ = ["HttpGetHandler", "HttpServer", "Proven", "Refused"]  # (the relay's imports)

MAX_REMEMBERED_HELLOS = 4096  # peers whose last hello time is kept (for dial-back proofs)
# A plain GET route: returns (content type, body), directly or awaited.
HttpGetHandler = Callable[[], tuple[str, bytes] | Awaitable[tuple[str, bytes]]]


def _caller_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


class HttpServer:
    """Routes, checks and limits of one node's server.

    Args:
        identity: this node's key pair (signs handshake replies).
        config: limits, timeouts and the swarm key.
        counters: the transport's byte counters.
        rpc_handlers, stream_handlers, get_handlers: what to serve, by name or path.
    """

    def __init__(
        self,
        identity: PeerIdentity,
        config: TransportConfig,
        *,
        counters: ByteCounters,
        rpc_handlers: dict[str, RpcHandler],
        stream_handlers: dict[str, StreamHandler],
        get_handlers: dict[str, HttpGetHandler],
    ):
        self.peer_id = identity.peer_id
        self.config = config
        self.limits = config.limits
        self.counters = counters
        self._rpc_handlers = rpc_handlers
        self._stream_handlers = stream_handlers
        self._get_handlers = get_handlers
        self.issuer = SessionIssuer(
            identity, swarm_key=config.swarm_key, lifetime_s=config.session_lifetime_s
        )
        self.swarm = SwarmAuth(config.swarm_key) if config.swarm_key else None
        self.door = Door(config)
        self.requests = self.door.requests
        self.hellos = self.requests.hellos  # (the relay counts the hellos it forwards here too)
        self.replay = self.door.replay
        self.budget = FairBudget(
            max_total=config.max_body_bytes_in_flight,
            max_per_peer=config.max_body_bytes_in_flight_per_peer,
            max_per_address=config.max_body_bytes_in_flight_per_address,
        )
        self.slots = StreamSlots(
            max_per_peer=config.max_streams_per_peer,
            max_per_address=config.max_streams_per_address,
            max_total=config.max_connections,  # each stream holds a connection
        )
        # peer id -> monotonic time of its last accepted hello (a dial-back's proof, see
        # dht.reach.reachability); bounded, the oldest forgotten first
        self._hello_times: OrderedDict[str, float] = OrderedDict()
        self.num_hellos = 0  # separate handshakes answered (POST /v2/hello)
        self.num_first_hellos = 0  # hellos accepted on a first request

    @property
    def num_refused(self) -> int:
        """Requests refused so far (any 4xx/5xx this server answered)."""
        return self.door.num_refused

    @property
    def tunnel_token(self) -> str | None:
        """Set while this node is relayed (see :meth:`Door.source_host`)."""
        return self.door.tunnel_token

    @tunnel_token.setter
    def tunnel_token(self, token: str | None) -> None:
        self.door.tunnel_token = token

    def connection_gate(self) -> ConnectionGate:
        """A gate of this server's connections (to install on its aiohttp ``web.Server``): its
        accept shares know which addresses this server answers requests for."""
        cfg = self.config
        return ConnectionGate(
            max_connections=cfg.max_connections,
            max_per_address=cfg.max_connections_per_address,
            accepts_per_s_per_address=cfg.max_connection_accepts_per_s_per_address,
            accept_burst_per_address=cfg.connection_accept_burst_per_address,
            contention_window_s=cfg.request_contention_window_s,
            requests=self.requests.addresses,
        )

    def hello_seen_since(self, peer_id: str, since_s: float) -> bool:
        """Whether ``peer_id`` made a session with this server at or after ``since_s``
        (monotonic seconds)."""
        return self._hello_times.get(peer_id, -float("inf")) >= since_s

    def source_host(self, request: web.Request) -> str:
        """The source IP of a request ("" for one relayed to this node: see
        :meth:`Door.source_host`)."""
        return self.door.source_host(request)

    def authenticate(self, request: web.Request) -> Proven:
        """Check a request at the door (see :meth:`Door.authenticate`)."""
        return self.door.authenticate(request, self.issuer)

    def authenticate_first(self, request: web.Request) -> tuple[Proven, HelloReply]:
        """Check a first request that carries its hello (``x-vp-hello``), headers only, as a
        handshake is checked: its address's share of requests and of handshakes first, then the
        swarm MAC and the signature (over the hello and this request, meant for this node),
        its proven peer's share of requests and its nonce in the replay window; only then the
        session is made. A refusal a separate handshake may cure is a 401 with
        ``x-vp-session: renew``."""
        share_host = self.door.admit_hello(request)
        wire = request.headers.get(HELLO_HEADER, "")
        try:
            if not printable_ascii(wire):
                raise BadMessageError("malformed x-vp-hello header")
            if self.swarm is not None:
                self.swarm.check_hello(wire.encode("ascii"), request.headers.get("x-vp-mac", ""))
            hello = HelloRequest.parse(decode_hello_header(wire, self.limits))
            if request.headers.get("x-vp-peer", hello.peer) != hello.peer:
                raise BadMessageError("x-vp-peer is not the peer the hello names")
            body_digest = _digest_header(request)
            first = FirstRequest(self.peer_id, request.method, request.path, body_digest)
            self.issuer.check_hello(hello, first=first)
            refuse_over_rate(self.requests.take_peer(hello.peer))
            self.replay.check(hello.peer, hello.nonce.hex(), f"{hello.ts:.3f}")
            reply, key = self.issuer.answer_with_key(hello)
        except AuthError as e:
            raise Refused(401, str(e), renew=True) from None
        except DHTError as e:
            raise Refused(status_of(e), str(e)) from None
        self._note_hello(hello.peer)
        host = self.door.source_host(request)
        return Proven(hello.peer, key, hello.nonce.hex(), body_digest, host, share_host), reply

    def _note_hello(self, peer_id: str) -> None:
        self._hello_times.pop(peer_id, None)
        self._hello_times[peer_id] = time.monotonic()
        while len(self._hello_times) > MAX_REMEMBERED_HELLOS:
            self._hello_times.popitem(last=False)

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self.door.refusals]
        )
        v = API_VERSION
        app.router.add_post(f"/{v}/hello", self._handle_hello)
        app.router.add_post(f"/{v}/rpc/{{name}}", self._handle_rpc)
        app.router.add_post(f"/{v}/stream/{{name}}", self._handle_stream)
        app.router.add_get(f"/{v}/info", self._handle_info)
        app.router.add_route("*", "/v1/{tail:.*}", self._handle_old_version)
        for path, handler in self._get_handlers.items():
            app.router.add_get(path, _plain_get(handler))
        return app

    async def _handle_old_version(self, request: web.Request) -> web.Response:
        raise Refused(426, f"this node speaks /{API_VERSION}/ (proven identity); upgrade")

    # ---- bodies ----------------------------------------------------------------------------

    async def _read_body(
        self, request: web.Request, max_bytes: int, *, peer: str = "", host: str = ""
    ) -> bytes:
        """The whole body: 413 at once if it announces more than ``max_bytes``; 503 if what
        arrived does not fit in the share of ``peer`` (a proven id; "" before a handshake) or of
        ``host``; 408 if it stalls or does not arrive in time. Charged as it arrives."""
        length = request.content_length
        if length is not None and length > max_bytes:
            raise Refused(413, f"body of {length} bytes exceeds the limit of {max_bytes}")
        try:
            with self.budget.account(peer, host) as account:
                async with asyncio.timeout(self.config.request_timeout_s):
                    return await read_charged(
                        request.content, max_bytes, account, self.config.body_stall_timeout_s
                    )
        except OverShare as e:
            raise Refused(503, f"busy: {e}") from None
        except TimeoutError:
            raise Refused(408, "request body not received in time") from None

    # ---- handlers ----------------------------------------------------------------------------

    async def _handle_info(self, request: web.Request) -> web.Response:
        return web.Response(
            body=pack({"peer_id": self.peer_id, "api": API_VERSION}), content_type=MSGPACK
        )

    async def _handle_hello(self, request: web.Request) -> web.Response:
        host = self.door.admit_hello(request)
        body = await self._read_body(request, MAX_HELLO_BYTES, host=host)
        try:
            if self.swarm is not None:
                self.swarm.check_hello(body, request.headers.get("x-vp-mac", ""))
            hello = HelloRequest.parse(unpack(body, self.limits))
            self.issuer.check_hello(hello)
            reply = self.issuer.answer(hello)
        except DHTError as e:
            raise Refused(status_of(e), str(e)) from None
        self._note_hello(hello.peer)
        self.num_hellos += 1
        return web.Response(body=pack(reply.to_wire()), content_type=MSGPACK)

    async def _handle_rpc(self, request: web.Request) -> web.Response:
        handler = self._rpc_handlers.get(request.match_info["name"])
        if handler is None:
            raise Refused(404, f"no RPC named {request.match_info['name']!r}")
        if HELLO_HEADER in request.headers:
            proven, reply = self.authenticate_first(request)
            self.num_first_hellos += 1
        else:
            proven, reply = self.authenticate(request), None
        body = await self._read_body(
            request, self.limits.max_body_bytes, peer=proven.peer_id, host=proven.share_host
        )
        self.requests.charge_body(
            proven.peer_id,
            proven.share_host,
            len(body) / self.config.request_body_bytes_per_request,
        )
        if digest(body) != proven.body_digest:
            raise Refused(401, "body does not match the digest its MAC covers")
        self.counters.add_recv(proven.peer_id, len(body))
        try:
            payload = unpack(body, self.limits)
            result = await handler(RequestContext(proven.peer_id, proven.host), payload)
        except DHTError as e:
            raise self.door.refused_for_share(proven.peer_id, status_of(e), str(e)) from None
        out = pack(result)
        headers = {
            "x-vp-peer": self.peer_id,
            "x-vp-mac": response_mac(proven.key, proven.nonce, 200, digest(out)),
        }
        if reply is not None:
            headers[HELLO_REPLY_HEADER] = encode_hello_header(reply.to_wire())
        self.counters.add_sent(proven.peer_id, len(out))
        self.counters.add_rpc(request.match_info["name"], len(out), len(body))
        return web.Response(body=out, content_type=MSGPACK, headers=headers)

    async def _handle_stream(self, request: web.Request) -> web.StreamResponse:
        handler = self._stream_handlers.get(request.match_info["name"])
        if handler is None:
            raise Refused(404, f"no stream named {request.match_info['name']!r}")
        proven = self.authenticate(request)
        try:
            with self.slots.hold(proven.peer_id, proven.share_host):
                return await self._serve_stream(request, proven, handler)
        except OverBudget as e:  # (refused as cheaply as at the door: no need to drain)
            raise Refused(429, str(e), retry_after_s=1) from None

    async def _read_stream_header(self, reader: FrameReader, proven: Proven):
        """A stream's first frame, its header: charged as it arrives, within the time to send a
        request, and matching the digest the MAC covered."""
        try:
            with self.budget.account(proven.peer_id, proven.share_host) as account:
                async with asyncio.timeout(self.config.request_timeout_s):
                    header_payload = await reader.read_message_raw(
                        charge=account.charge, stall_timeout_s=self.config.body_stall_timeout_s
                    )
            self.requests.charge_body(
                proven.peer_id, proven.share_host,
                len(header_payload) / self.config.request_body_bytes_per_request,
            )  # fmt: skip
            if digest(header_payload) != proven.body_digest:
                raise Refused(401, "stream header does not match the digest its MAC covers")
            return unpack(header_payload, self.limits)
        except TimeoutError:
            raise Refused(408, "stream header not received in time") from None
        except OverShare as e:
            raise Refused(503, f"busy: {e}") from None
        except RemoteError:
            raise Refused(400, "a stream's first frame must be its header, not an error") from None
        except TransportError as e:  # the caller's connection broke while it sent the header
            raise ClientGone(str(e)) from None
        except DHTError as e:
            raise Refused(status_of(e), str(e)) from None

    async def _serve_stream(self, request: web.Request, proven: Proven, handler: StreamHandler):
        tagger = FrameTagger(proven.key, proven.nonce) if self.swarm is not None else None
        reader = FrameReader(
            request.content,
            limits=self.limits,
            tagger=tagger,
            idle_timeout_s=self.config.stream_idle_timeout_s,
            direction=b"up",
        )
        header = await self._read_stream_header(reader, proven)
        stream = ServerStream(
            request,
            sender=proven.peer_id,
            header=header,
            reader=reader,
            key=proven.key,
            nonce=proven.nonce,
            tagger=tagger,
            counters=self.counters,
            own_peer_id=self.peer_id,
            write_timeout_s=self.config.stream_write_timeout_s,
            remote_host=proven.host,
        )
        try:
            try:
                await handler(stream)
            except (DHTError, TimeoutError) as e:
                if isinstance(e, TransportError) and _caller_gone(request):
                    raise ClientGone(str(e)) from None
                status = status_of(e) if isinstance(e, DHTError) else 408
                if not stream.reply_started:
                    raise Refused(status, str(e) or "timed out") from None
                logger.warning("stream %s from %s aborted: %s", request.path, proven.peer_id[:8], e)
                await stream.abort(str(e) or "timed out")
            return await stream.finish()
        finally:
            stream.close()


def _digest_header(request: web.Request) -> bytes:
    value = request.headers.get("x-vp-digest", "")
    try:
        body_digest = bytes.fromhex(value)
    except ValueError:
        body_digest = b""
    if len(value) != 64 or len(body_digest) != 32:  # (fromhex skips whitespace)
        raise BadMessageError("missing or malformed x-vp-digest header")
    return body_digest


def _plain_get(handler: HttpGetHandler):
    async def handle(request: web.Request) -> web.Response:
        result = handler()
        content_type, body = await result if inspect.isawaitable(result) else result
        return web.Response(body=body, headers={"content-type": content_type})

    return handle
