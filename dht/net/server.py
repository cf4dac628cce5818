"""The node's side of the aiohttp transport: handshakes, RPCs and streams, proven and bounded.

The order of checks spends as little as possible on a stranger: a connection over the caps is
closed before it is parsed (:class:`dht.net.limits.ConnectionGate`); a request's headers are
authenticated (session ticket, MAC, timestamp, nonce) before a byte of its body is read; a
``Content-Length`` over the limit is refused at once (413); bodies are read only within a global
budget of bytes in flight, and their digest must match the one the MAC covered. Each source
address and each proven peer has a share of the requests handled (:mod:`dht.net.request_shares`),
checked before the request is authenticated and right after: past it a request is refused (429
with a ``Retry-After``) before any other work. Every refusal is
a 4xx/5xx whose reason is in the ``x-vp-error`` header and the body, logged as one line (at most
one line per second per reason kind under a flood); the node keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from dht.errors import (
    AuthError,
    DHTError,
    RemoteError,
    TransportError,
)
from dht.identity import PeerIdentity
from dht.net.auth import FrameTagger, SwarmAuth
from dht.net.client import API_VERSION, MAX_HELLO_BYTES, MSGPACK, TUNNEL_HEADER
from dht.net.config import TransportConfig
from dht.net.frames import FrameReader
from dht.net.limits import OverBudget, RateLimiter, StreamSlots, peer_host
from dht.net.refusals import (
    ClientGone,
    Refused,
    error_response,
    read_charged,
    status_of,
)
from dht.net.replay import ReplayGuard
from dht.net.request_shares import RateRefusal, RequestShares
from dht.net.session import (
    HelloRequest,
    SessionIssuer,
    digest,
    macs_equal,
    request_mac,
    response_mac,
)
from dht.net.shares import FairBudget, OverShare
from dht.net.streams import ServerStream
from dht.net.transport import ByteCounters, RequestContext, RpcHandler, StreamHandler
from dht.net.wire import pack, unpack

logger = logging.getLogger(__name__)

_HEX = re.compile(r"[0-9a-f]+")
MAX_REMEMBERED_HELLOS = 4096  # peers whose last hello time is kept (for dial-back proofs)
# A plain GET route: returns (content type, body), directly or awaited.
HttpGetHandler = Callable[[], tuple[str, bytes] | Awaitable[tuple[str, bytes]]]


@dataclass(frozen=True)
class Proven:
    """An authenticated request: who sent it, the session key, and what its MAC covered."""

    peer_id: str
    key: bytes
    nonce: str
    body_digest: bytes
    host: str


def _caller_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _hex_header(request: web.Request, name: str, length: int) -> str:
    value = request.headers.get(name, "")
    if len(value) != length or not _HEX.fullmatch(value):
        raise Refused(401, f"missing or malformed {name} header")
    return value


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
        self.replay = ReplayGuard(
            window_s=config.replay_window_s, max_entries=config.max_remembered_nonces
        )
        self.swarm = SwarmAuth(config.swarm_key) if config.swarm_key else None
        self.hellos = RateLimiter(
            rate_per_s=config.max_handshakes_per_s_per_address, burst=config.handshake_burst
        )
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
        self.requests = RequestShares(
            rate_per_s_per_peer=config.max_requests_per_s_per_peer,
            burst_per_peer=config.request_burst_per_peer,
            rate_per_s_per_address=config.max_requests_per_s_per_address,
            burst_per_address=config.request_burst_per_address,
            max_hold_s=config.max_refusal_hold_s,
            contention_window_s=config.request_contention_window_s,
        )
        self.num_refused = 0
        self._last_log_s: dict[int, float] = {}
        # peer id -> monotonic time of its last accepted hello (a dial-back's proof, see
        # dht.reach.reachability); bounded, the oldest forgotten first
        self._hello_times: OrderedDict[str, float] = OrderedDict()
        # Set while this node is relayed (dht.reach.relay_client): its tunnel's local requests carry
        # it, so they are known to come through the relay and not from this host.
        self.tunnel_token: str | None = None

    def hello_seen_since(self, peer_id: str, since_s: float) -> bool:
        """Whether ``peer_id`` made a session with this server at or after ``since_s``
        (monotonic seconds)."""
        return self._hello_times.get(peer_id, -float("inf")) >= since_s

    def source_host(self, request: web.Request) -> str:
        """The source IP of a request; "" for one that came through this node's relay tunnel
        (the relay already applied the per-address limits, and this node cannot verify the
        caller's address: its claims are pinged back)."""
        token = self.tunnel_token
        if token is not None and macs_equal(token, request.headers.get(TUNNEL_HEADER, "")):
            return ""
        return peer_host(request.transport)

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._refusals]
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

    # ---- refusals ----------------------------------------------------------------------------

    @web.middleware
    async def _refusals(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ClientGone as e:
            logger.debug("caller of %s went away: %s", request.path[:80], e)
            return web.Response(status=400, text="request cut short")
        except Refused as e:
            refused = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            refused = Refused(e.status, e.reason)
        self.num_refused += 1
        self._log_refusal(request, refused.status, refused.reason)
        if refused.hold_s > 0:  # it ignored its last Retry-After: this answer waits for it
            await asyncio.sleep(refused.hold_s)
        return error_response(
            refused.status, refused.reason, renew=refused.renew,
            retry_after_s=refused.retry_after_s,
        )  # fmt: skip

    def _log_refusal(self, request: web.Request, status: int, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_log_s.get(status, -float("inf")) < 1.0:
            return  # one line per second per status: a flood must not flood the log
        self._last_log_s[status] = now
        sender = request.headers.get("x-vp-peer", "?")[:16]
        sender = sender if _printable_ascii(sender) else "?"
        host = peer_host(request.transport)
        logger.warning(
            "refused %s %s from %s (%s): %d %s (%d refusals so far)",
            request.method, request.path[:80].encode("ascii", "backslashreplace").decode(),
            sender, host, status, reason,
            self.num_refused,
        )  # fmt: skip

    async def _handle_old_version(self, request: web.Request) -> web.Response:
        raise Refused(426, f"this node speaks /{API_VERSION}/ (proven identity); upgrade")

    # ---- authentication ----------------------------------------------------------------------

    def authenticate(self, request: web.Request) -> Proven:
        """Check a request's session ticket, MAC, timestamp and nonce (headers only), each
        within its sender's share of requests: its source address's before anything else, its
        proven peer id's once the MAC checks."""
        host = self.source_host(request)
        _refuse_over_rate(self.requests.take_address(host))
        ticket = request.headers.get("x-vp-ticket", "")
        if not ticket or len(ticket) > 512 or not _printable_ascii(ticket):
            raise Refused(
                401, f"no session: make one first (POST /{API_VERSION}/hello)", renew=True
            )
        try:
            caller = self.issuer.open_ticket(ticket)
        except AuthError as e:
            raise Refused(401, str(e), renew=True) from None
        claimed = request.headers.get("x-vp-peer")
        if claimed is not None and claimed != caller.peer_id:
            raise Refused(401, "x-vp-peer is not the peer the session was made with")
        nonce = _hex_header(request, "x-vp-nonce", 32)
        body_digest = bytes.fromhex(_hex_header(request, "x-vp-digest", 64))
        mac = _hex_header(request, "x-vp-mac", 64)
        ts = request.headers.get("x-vp-ts", "")[:32]
        if not _printable_ascii(ts):  # (headers are decoded leniently: anything may be here)
            raise Refused(401, "malformed x-vp-ts header")
        expected = request_mac(caller.key, request.method, request.path, body_digest, ts, nonce)
        if not macs_equal(expected, mac):
            raise Refused(401, "wrong request MAC")
        _refuse_over_rate(self.requests.take_peer(caller.peer_id))
        try:
            self.replay.check(caller.peer_id, nonce, ts)
        except AuthError as e:
            raise Refused(401, str(e)) from None
        return Proven(caller.peer_id, caller.key, nonce, body_digest, host)

    def _refused_for_share(self, peer: str, status: int, reason: str) -> Refused:
        """A refusal because ``peer`` holds its share of a pool (429): its request bucket is
        emptied, so that a retry at once costs only the door's check (see
        :meth:`RequestShares.drain`)."""
        if status != 429:
            return Refused(status, reason)
        return Refused(429, reason, retry_after_s=self.requests.drain(peer))

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
        host = self.source_host(request)
        if host and not self.hellos.allow(host):
            raise Refused(429, "too many handshakes from this address; slow down")
        body = await self._read_body(request, MAX_HELLO_BYTES, host=host)
        try:
            if self.swarm is not None:
                self.swarm.check_hello(body, request.headers.get("x-vp-mac", ""))
            hello = HelloRequest.parse(unpack(body, self.limits))
            self.issuer.check_hello(hello)
            reply = self.issuer.answer(hello)
        except DHTError as e:
            raise Refused(status_of(e), str(e)) from None
        self._hello_times.pop(hello.peer, None)
        self._hello_times[hello.peer] = time.monotonic()
        while len(self._hello_times) > MAX_REMEMBERED_HELLOS:
            self._hello_times.popitem(last=False)
        return web.Response(body=pack(reply.to_wire()), content_type=MSGPACK)

    async def _handle_rpc(self, request: web.Request) -> web.Response:
        handler = self._rpc_handlers.get(request.match_info["name"])
        if handler is None:
            raise Refused(404, f"no RPC named {request.match_info['name']!r}")
        proven = self.authenticate(request)
        body = await self._read_body(
            request, self.limits.max_body_bytes, peer=proven.peer_id, host=proven.host
        )
        self.requests.charge_body(
            proven.peer_id, proven.host, len(body) / self.config.request_body_bytes_per_request
        )
        if digest(body) != proven.body_digest:
            raise Refused(401, "body does not match the digest its MAC covers")
        self.counters.add_recv(proven.peer_id, len(body))
        try:
            payload = unpack(body, self.limits)
            result = await handler(RequestContext(proven.peer_id, proven.host), payload)
        except DHTError as e:
            raise self._refused_for_share(proven.peer_id, status_of(e), str(e)) from None
        out = pack(result)
        headers = {
            "x-vp-peer": self.peer_id,
            "x-vp-mac": response_mac(proven.key, proven.nonce, 200, digest(out)),
        }
        self.counters.add_sent(proven.peer_id, len(out))
        self.counters.add_rpc(request.match_info["name"], len(out), len(body))
        return web.Response(body=out, content_type=MSGPACK, headers=headers)

    async def _handle_stream(self, request: web.Request) -> web.StreamResponse:
        handler = self._stream_handlers.get(request.match_info["name"])
        if handler is None:
            raise Refused(404, f"no stream named {request.match_info['name']!r}")
        proven = self.authenticate(request)
        try:
            with self.slots.hold(proven.peer_id, proven.host):
                return await self._serve_stream(request, proven, handler)
        except OverBudget as e:  # (refused as cheaply as at the door: no need to drain)
            raise Refused(429, str(e), retry_after_s=1) from None

    async def _serve_stream(self, request: web.Request, proven: Proven, handler: StreamHandler):
        tagger = FrameTagger(proven.key, proven.nonce) if self.swarm is not None else None
        reader = FrameReader(
            request.content,
            limits=self.limits,
            tagger=tagger,
            idle_timeout_s=self.config.stream_idle_timeout_s,
            direction=b"up",
        )
        try:
            with self.budget.account(proven.peer_id, proven.host) as account:
                async with asyncio.timeout(self.config.request_timeout_s):
                    header_payload = await reader.read_message_raw(
                        charge=account.charge, stall_timeout_s=self.config.body_stall_timeout_s
                    )
            self.requests.charge_body(
                proven.peer_id, proven.host,
                len(header_payload) / self.config.request_body_bytes_per_request,
            )  # fmt: skip
            if digest(header_payload) != proven.body_digest:
                raise Refused(401, "stream header does not match the digest its MAC covers")
            header = unpack(header_payload, self.limits)
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


def _refuse_over_rate(refusal: RateRefusal | None) -> None:
    if refusal is not None:
        raise Refused(
            429, refusal.reason, retry_after_s=refusal.retry_after_s, hold_s=refusal.hold_s
        )


def _plain_get(handler: HttpGetHandler):
    async def handle(request: web.Request) -> web.Response:
        result = handler()
        content_type, body = await result if inspect.isawaitable(result) else result
        return web.Response(body=body, headers={"content-type": content_type})

    return handle
