"""The aiohttp transport: one server and one keep-alive ClientSession per node.

Paths are versioned: ``POST /v1/rpc/{name}`` carries one msgpack request and answers one msgpack
response; ``POST /v1/stream/{name}`` carries frames both ways, full duplex; ``GET /v1/info`` says
who this node is. Every refusal is a 4xx whose reason is in the ``x-vp-error`` header and the body,
logged as one line; the node keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from dht.auth import SwarmAuth, body_digest
from dht.errors import (
    AuthError,
    BadMessageError,
    BusyError,
    DHTError,
    RemoteError,
    RequestTimeoutError,
    TransportError,
    ValidationError,
)
from dht.frames import FrameReader, FrameWriter
from dht.http_config import TransportConfig
from dht.http_streams import ClientStream, ServerStream
from dht.identity import PeerIdentity, is_peer_id
from dht.transport import ByteCounters, RequestContext, RpcHandler, StreamHandler
from dht.wire import pack, unpack

logger = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
API_VERSION = "v1"
_STATUS_OF = {BadMessageError: 400, AuthError: 401, ValidationError: 422, BusyError: 429}
# A plain GET route: returns (content type, body), directly or awaited.
HttpGetHandler = Callable[[], tuple[str, bytes] | Awaitable[tuple[str, bytes]]]


class Refused(Exception):
    """Internal: a request refused with an HTTP status and a one-line reason."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def status_of(error: DHTError) -> int:
    for kind, status in _STATUS_OF.items():
        if isinstance(error, kind):
            return status
    return 500


def _error_response(status: int, reason: str) -> web.Response:
    safe = reason.encode("ascii", "replace").decode()[:300]
    return web.Response(status=status, text=safe, headers={"x-vp-error": safe})


class HttpTransport:
    """:class:`dht.transport.Transport` over aiohttp.

    Args:
        identity: this node's key pair; its peer id goes with every request.
        config: where to listen, the swarm key, TLS files, limits and timeouts.
    """

    def __init__(self, identity: PeerIdentity, config: TransportConfig):
        self.peer_id = identity.peer_id
        self.config = config
        self.limits = config.limits
        self.counters = ByteCounters()
        self._auth = (
            SwarmAuth(config.swarm_key, replay_window_s=config.replay_window_s)
            if config.swarm_key
            else None
        )
        self._rpc_handlers: dict[str, RpcHandler] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._get_handlers: dict[str, HttpGetHandler] = {}
        self._active_streams: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._address: str | None = None
        self._closed = False

    @property
    def address(self) -> str | None:
        return self._address

    def add_rpc_handler(self, name: str, handler: RpcHandler) -> None:
        """Serve ``POST /v1/rpc/{name}``; also after :meth:`start` (a component attached to a
        running node, as the library's optimizer to its DHT: requests before get a 404)."""
        self._rpc_handlers[name] = handler

    def add_stream_handler(self, name: str, handler: StreamHandler) -> None:
        """Serve ``POST /v1/stream/{name}``; also after :meth:`start`, as RPC handlers."""
        self._stream_handlers[name] = handler

    def add_http_get(self, path: str, handler: HttpGetHandler) -> None:
        """Serve ``GET path`` with ``handler() -> (content_type, body)`` (sync or async).

        For plain read-only endpoints such as Prometheus' ``/metrics``: no swarm MAC is asked
        (scrapers cannot sign), so serve nothing secret here. ``path`` must start with ``/``
        and stay outside the versioned API (``/v1/...``).
        """
        if self._runner is not None:
            raise RuntimeError("add handlers before start()")
        if not path.startswith("/") or path.startswith(f"/{API_VERSION}/"):
            raise ValueError(f"GET path must start with / and not /{API_VERSION}/: {path!r}")
        self._get_handlers[path] = handler

    async def start(self) -> None:
        """Open the client session and, unless in client mode, start serving."""
        cfg = self.config
        client_ssl = ssl.create_default_context(cafile=cfg.tls_ca_file) if cfg.tls_ca_file else None
        connector = aiohttp.TCPConnector(limit=0, ssl=client_ssl if client_ssl else True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s),
            auto_decompress=False,
        )
        if cfg.client_mode:
            return
        app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._refusals]
        )
        app.router.add_post(f"/{API_VERSION}/rpc/{{name}}", self._handle_rpc)
        app.router.add_post(f"/{API_VERSION}/stream/{{name}}", self._handle_stream)
        app.router.add_get(f"/{API_VERSION}/info", self._handle_info)
        for path, handler in self._get_handlers.items():
            app.router.add_get(path, _plain_get(handler))
        server_ssl = None
        if cfg.tls_cert_file:
            server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_ssl.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port, ssl_context=server_ssl)
        try:
            await site.start()
        except OSError as e:
            await self.close()
            raise TransportError(f"cannot listen on {cfg.host}:{cfg.port}: {e}") from e
        port = self._runner.addresses[0][1]
        scheme = "https" if server_ssl else "http"
        self._address = f"{scheme}://{cfg.announced_host()}:{port}"

    async def close(self) -> None:
        """Stop serving and close the client session; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> HttpTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- server side -------------------------------------------------------------------------

    @web.middleware
    async def _refusals(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as e:
            status, reason = e.status, e.reason
        except web.HTTPException as e:
            if e.status < 400:
                raise
            status, reason = e.status, e.reason
        sender = request.headers.get("x-vp-peer", "?")[:16]
        logger.warning(
            "refused %s %s from %s: %d %s", request.method, request.path, sender, status, reason
        )
        return _error_response(status, reason)

    def _sender(self, request: web.Request) -> str:
        sender = request.headers.get("x-vp-peer", "")
        if not is_peer_id(sender):
            raise Refused(400, "missing or malformed x-vp-peer header")
        return sender

    async def _handle_info(self, request: web.Request) -> web.Response:
        return web.Response(
            body=pack({"peer_id": self.peer_id, "api": API_VERSION}), content_type=MSGPACK
        )

    async def _handle_rpc(self, request: web.Request) -> web.Response:
        handler = self._rpc_handlers.get(request.match_info["name"])
        if handler is None:
            raise Refused(404, f"no RPC named {request.match_info['name']!r}")
        sender = self._sender(request)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                body = await request.read()
        except TimeoutError:
            raise Refused(408, "request body not received in time") from None
        try:
            if self._auth is not None:
                self._auth.check_request(
                    request.method, request.path, body_digest(body), request.headers
                )
            payload = unpack(body, self.limits)
            self.counters.add_recv(sender, len(body))
            result = await handler(RequestContext(sender=sender), payload)
        except DHTError as e:
            raise Refused(status_of(e), str(e)) from None
        out = pack(result)
        headers = {"x-vp-peer": self.peer_id}
        if self._auth is not None:
            headers["x-vp-mac"] = self._auth.sign_response(
                request.headers["x-vp-nonce"], 200, body_digest(out)
            )
        self.counters.add_sent(sender, len(out))
        return web.Response(body=out, content_type=MSGPACK, headers=headers)

    async def _handle_stream(self, request: web.Request) -> web.StreamResponse:
        handler = self._stream_handlers.get(request.match_info["name"])
        if handler is None:
            raise Refused(404, f"no stream named {request.match_info['name']!r}")
        sender = self._sender(request)
        if self._active_streams[sender] >= self.config.max_streams_per_peer:
            raise Refused(429, f"more than {self.config.max_streams_per_peer} concurrent streams")
        self._active_streams[sender] += 1
        try:
            return await self._serve_stream(request, sender, handler)
        finally:
            self._active_streams[sender] -= 1
            if not self._active_streams[sender]:
                del self._active_streams[sender]

    async def _serve_stream(self, request: web.Request, sender: str, handler: StreamHandler):
        nonce = request.headers.get("x-vp-nonce", "")
        if self._auth is not None and "x-vp-mac" not in request.headers:
            raise Refused(401, "missing swarm MAC")
        reader = FrameReader(
            request.content,
            limits=self.limits,
            auth=self._auth,
            nonce=nonce,
            idle_timeout_s=self.config.stream_idle_timeout_s,
            direction=b"up",
        )
        try:
            header_payload = await reader.read_message_raw()
            if self._auth is not None:
                self._auth.check_request(
                    request.method, request.path, body_digest(header_payload), request.headers
                )
            header = unpack(header_payload, self.limits)
        except TimeoutError:
            raise Refused(408, "stream header not received in time") from None
        except DHTError as e:
            raise Refused(status_of(e), str(e)) from None
        stream = ServerStream(
            request,
            sender=sender,
            header=header,
            reader=reader,
            auth=self._auth,
            nonce=nonce,
            counters=self.counters,
            own_peer_id=self.peer_id,
        )
        try:
            await handler(stream)
        except (DHTError, TimeoutError) as e:
            status = status_of(e) if isinstance(e, DHTError) else 408
            if not stream.reply_started:
                raise Refused(status, str(e) or "timed out") from None
            logger.warning("stream %s from %s aborted: %s", request.path, sender[:8], e)
            await stream.abort(str(e) or "timed out")
        return await stream.finish()

    # ---- client side -------------------------------------------------------------------------

    def _request_headers(self, path: str, digest: bytes) -> dict[str, str]:
        headers = {"x-vp-peer": self.peer_id, "content-type": MSGPACK}
        if self._auth is not None:
            headers.update(self._auth.sign_request("POST", path, digest, self.peer_id))
        return headers

    async def call(
        self, address: str, name: str, payload: Any, *, timeout_s: float | None = None
    ) -> Any:
        if self._session is None or self._session.closed:
            raise TransportError("transport is not started or already closed")
        path = f"/{API_VERSION}/rpc/{name}"
        body = pack(payload)
        headers = self._request_headers(path, body_digest(body))
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(address + path, data=body, headers=headers) as resp:
                    data = await _read_limited(resp, self.limits.max_body_bytes)
        except TimeoutError:
            raise RequestTimeoutError(
                f"{name} to {address} took longer than {timeout_s} s"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError) as e:
            raise TransportError(f"{name} to {address} failed: {e}") from e
        if resp.status != 200:
            raise RemoteError(resp.status, resp.headers.get("x-vp-error") or resp.reason or "")
        if self._auth is not None:
            self._auth.check_response(
                headers["x-vp-nonce"], 200, body_digest(data), resp.headers.get("x-vp-mac", "")
            )
        remote = resp.headers.get("x-vp-peer", address)
        self.counters.add_sent(remote, len(body))
        self.counters.add_recv(remote, len(data))
        return unpack(data, self.limits)

    def open_stream(
        self, address: str, name: str, header: Any, *, timeout_s: float | None = None
    ) -> ClientStream:
        if self._session is None or self._session.closed:
            raise TransportError("transport is not started or already closed")
        path = f"/{API_VERSION}/stream/{name}"
        header_bytes = pack(header)
        headers = self._request_headers(path, body_digest(header_bytes))
        return ClientStream(
            self._session,
            address + path,
            headers=headers,
            header_bytes=header_bytes,
            limits=self.limits,
            auth=self._auth,
            counters=self.counters,
            idle_timeout_s=self.config.stream_idle_timeout_s if timeout_s is None else timeout_s,
        )


def _plain_get(handler: HttpGetHandler):
    async def handle(request: web.Request) -> web.Response:
        result = handler()
        content_type, body = await result if inspect.isawaitable(result) else result
        return web.Response(body=body, headers={"content-type": content_type})

    return handle


async def _read_limited(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise BadMessageError(f"response of {resp.content_length} bytes exceeds {max_bytes}")
    data = await resp.content.read(max_bytes + 1)
    while len(data) <= max_bytes and not resp.content.at_eof():
        more = await resp.content.read(max_bytes + 1 - len(data))
        if not more:
            break
        data += more
    if len(data) > max_bytes:
        raise BadMessageError(f"response exceeds {max_bytes} bytes")
    return data


__all__ = ["FrameReader", "FrameWriter", "HttpTransport", "TransportConfig"]
