"""The aiohttp transport: one server and one keep-alive ClientSession per node.

Paths are versioned (``/v2/``; ``/v1/`` is answered 426): ``POST /v2/hello`` makes a session
(:mod:`dht.net.session`), ``POST /v2/rpc/{name}`` carries one msgpack request and answers one
msgpack response, ``POST /v2/stream/{name}`` carries frames both ways, full duplex, and ``GET
/v2/info`` says who this node claims to be. Every request and answer after the handshake is proven
under the session key; the first RPC to a known peer carries its hello instead of a handshake
first (:mod:`dht.net.client`); the server's checks and limits are in :mod:`dht.net.server`.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import time
from typing import Any

import aiohttp
from aiohttp import web

from dht.errors import BadMessageError, RequestTimeoutError, TransportError
from dht.identity import PeerIdentity
from dht.net.client import (
    API_VERSION,
    ClientSessions,
)
from dht.net.config import TransportConfig
from dht.net.frames import FrameReader, FrameWriter
from dht.net.limits import ConnectionGate
from dht.net.listener import start_gated_sites
from dht.net.refusals import HTTP_PARSER_LOGGER, Refused, status_of
from dht.net.server import HttpGetHandler, HttpServer
from dht.net.streams import ClientStream
from dht.net.transport import SMALL_RPC_BYTES, ByteCounters, RpcHandler, StreamHandler
from dht.net.wire import pack, unpack
from dht.reach.port_mapping import PortMapping
from dht.reach.reachability import DIAL_BACK, DialBackService, Reachability
from dht.reach.relay_client import AddressListener, Candidates, RelayTunnel
from dht.reach.relay_server import RelayService

MSGPACK = "application/msgpack"


class HttpTransport:
    """:class:`dht.net.transport.Transport` over aiohttp.

    Args:
        identity: this node's key pair; it proves this node to every node it calls and to
            every caller.
        config: where to listen, the swarm key, TLS files, limits and timeouts.
    """

    def __init__(self, identity: PeerIdentity, config: TransportConfig):
        self.peer_id = identity.peer_id
        self.identity = identity
        self.config = config
        self.limits = config.limits
        self.counters = ByteCounters()
        self.sessions = ClientSessions(identity, swarm_key=config.swarm_key, limits=config.limits)
        self._rpc_handlers: dict[str, RpcHandler] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._get_handlers: dict[str, HttpGetHandler] = {}
        self.server: HttpServer | None = None
        self.gate: ConnectionGate | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._address: str | None = None
        self.relay: RelayService | None = None
        self._tunnel: RelayTunnel | None = None
        self._closed = False
        # set by dht.reach.reachability.settle_reachability once the swarm was asked
        self.reachability: Reachability | None = None
        self.port_mapping: PortMapping | None = None  # kept by settle_reachability; closed here
        self.dial_back = DialBackService(self, config.reachability)
        self._rpc_handlers[DIAL_BACK] = self.dial_back.handle

    @property
    def address(self) -> str | None:
        """Where others reach this node: its own URL, or its relayed address once relayed."""
        if self._tunnel is not None and self._tunnel.address is not None:
            return self._tunnel.address
        return self._address

    @property
    def relayed(self) -> bool:
        """Whether others reach this node through a relay (see :meth:`attach_relay`)."""
        return self._tunnel is not None

    @property
    def relay_url(self) -> str | None:
        """The URL of the relay this node is reached through now, if relayed."""
        return self._tunnel.relay_url if self._tunnel is not None else None

    async def attach_relay(
        self, candidates: Candidates, *, on_address_change: AddressListener | None = None
    ) -> str:
        """Be reached through a relay: attach to the first of ``candidates`` that accepts.

        The node keeps its server on its local port and a tunnel to the relay open; requests to
        ``{relay}/v2/relay/{peer_id}`` reach this node's handlers unchanged. When the relay goes
        away, the node attaches to another candidate (``candidates`` may be a function, asked
        again each time), :attr:`address` changes, and ``on_address_change(new_address)`` is
        called. A relayed node relays for no one.

        Args:
            candidates: URLs of reachable nodes (``http(s)://host:port``), or a function
                returning them.
            on_address_change: called with the new address after each move to another relay.

        Returns:
            The relayed address (:attr:`address` from now on).

        Raises:
            TransportError: no candidate accepted (why, for each), or the node serves nothing.
        """
        if self._runner is None or self._session is None:
            raise TransportError("attach_relay needs a started node that serves (not client mode)")
        if self._tunnel is not None:
            raise TransportError(f"already relayed through {self._tunnel.relay_url}")
        if self.relay is not None:
            await self.relay.close("this node relays for no one: it is relayed itself")
        self.server.tunnel_token = secrets.token_hex(16)
        tunnel = RelayTunnel(
            http=self._session,
            sessions=self.sessions,
            peer_id=self.peer_id,
            local_url=self._local_url(),
            tunnel_token=self.server.tunnel_token,
            config=self.config,
            candidates=candidates,
        )
        if on_address_change is not None:
            tunnel.add_listener(on_address_change)
        try:
            address = await tunnel.start()
        except BaseException:
            self.server.tunnel_token = None
            raise
        self._tunnel = tunnel
        return address

    def add_address_listener(self, listener: AddressListener) -> None:
        """Call ``listener(new_address)`` whenever a relayed node moves to another relay."""
        if self._tunnel is None:
            raise TransportError("not relayed: call attach_relay() first")
        self._tunnel.add_listener(listener)

    def _local_url(self) -> str:
        host, port = self._runner.addresses[0][:2]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        host = f"[{host}]" if ":" in host else host
        scheme = "https" if self.config.tls_cert_file else "http"
        return f"{scheme}://{host}:{port}"

    def add_rpc_handler(self, name: str, handler: RpcHandler) -> None:
        """Serve ``POST /v1/rpc/{name}``; also after :meth:`start` (a component attached to a
        running node, as the library's optimizer to its DHT: requests before get a 404)."""
        self._rpc_handlers[name] = handler

    def add_stream_handler(self, name: str, handler: StreamHandler) -> None:
        """Serve ``POST /v1/stream/{name}``; also after :meth:`start`, as RPC handlers."""
        self._stream_handlers[name] = handler

    def add_http_get(self, path: str, handler: HttpGetHandler) -> None:
        """Serve ``GET path`` with ``handler() -> (content_type, body)`` (sync or async).

        For plain read-only endpoints such as Prometheus' ``/metrics``: nothing is proven
        (scrapers cannot sign), so serve nothing secret here. ``path`` must start with ``/``
        and stay outside the versioned API.
        """
        if self._runner is not None:
            raise RuntimeError("add handlers before start()")
        if not path.startswith("/") or path.startswith(("/v1/", f"/{API_VERSION}/")):
            raise ValueError(f"GET path must start with / and not /{API_VERSION}/: {path!r}")
        self._get_handlers[path] = handler

    async def start(self) -> None:
        """Open the client session and, unless in client mode, start serving."""
        cfg = self.config
        client_ssl = ssl.create_default_context(cafile=cfg.tls_ca_file) if cfg.tls_ca_file else None
        connector = aiohttp.TCPConnector(
            limit=0,
            keepalive_timeout=cfg.client_keepalive_s,
            ssl=client_ssl if client_ssl else True,
            local_addr=(cfg.source_host, 0) if cfg.source_host else None,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s),
            auto_decompress=False,
        )
        if cfg.client_mode:
            return
        self.server = HttpServer(
            self.identity,
            cfg,
            counters=self.counters,
            rpc_handlers=self._rpc_handlers,
            stream_handlers=self._stream_handlers,
            get_handlers=self._get_handlers,
        )
        server_ssl = None
        if cfg.tls_cert_file:
            server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_ssl.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
        app = self.server.application()
        if cfg.relay_enabled:
            self.relay = RelayService(self.server, cfg)
            self.relay.add_routes(app)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=cfg.idle_connection_timeout_s,
            max_headers=cfg.max_header_fields,
            max_field_size=cfg.max_header_field_bytes,
            max_line_size=cfg.max_header_field_bytes,
            logger=HTTP_PARSER_LOGGER,
        )
        await self._runner.setup()
        self.gate = self.server.connection_gate()
        self.gate.install(self._runner.server)
        try:  # (its sockets' accept() asks the gate first: a refusal costs little)
            await start_gated_sites(
                self._runner, cfg.host, cfg.port, self.gate, ssl_context=server_ssl
            )
        except OSError as e:
            await self.close()
            raise TransportError(f"cannot listen on {cfg.host}:{cfg.port}: {e}") from e
        port = self._runner.addresses[0][1]
        scheme = "https" if server_ssl else "http"
        self._address = f"{scheme}://{cfg.announced_host()}:{port}"

    async def stop_serving(self) -> None:
        """Close the server and drop the address (client mode from here); the client session
        stays. For a node that learned nobody can dial it (:mod:`dht.reach.reachability`)."""
        runner, self._runner, self.server, self.gate = self._runner, None, None, None
        self._address = None
        if runner is not None:
            await runner.cleanup()

    def announce_host(self, host: str) -> None:
        """Announce ``host`` (an IP address others saw this node at) instead of the configured
        one; the port and scheme stay."""
        if self._address is None:
            raise TransportError("announce_host: this node serves nothing")
        self.announce_address(host, int(self._address.rsplit(":", 1)[1]))

    def announce_address(self, host: str, port: int) -> None:
        """Announce ``host:port`` (e.g. a port mapped on the gateway) instead of the listening
        address; the scheme stays."""
        if self._address is None:
            raise TransportError("announce_address: this node serves nothing")
        scheme = self._address.partition("://")[0]
        url_host = f"[{host}]" if ":" in host else host
        self._address = f"{scheme}://{url_host}:{port}"

    def hello_seen_since(self, peer_id: str, since_s: float) -> bool:
        """Whether ``peer_id`` made a session with this node's server at or after ``since_s``
        (monotonic seconds); False when not serving."""
        return self.server is not None and self.server.hello_seen_since(peer_id, since_s)

    async def dial(self, address: str, *, expected_peer: str, timeout_s: float) -> None:
        """Make a fresh handshake with ``address`` (no cached session is used, none is kept)
        and check that ``expected_peer`` proves itself there.

        Raises:
            WrongPeerError: another peer answers there.
            RequestTimeoutError, RemoteError, TransportError: the handshake failed.
        """
        if self._session is None or self._session.closed:
            raise TransportError("transport is not started or already closed")
        fresh = ClientSessions(
            self.identity, swarm_key=self.config.swarm_key, limits=self.limits, max_sessions=1
        )
        try:
            await fresh.get(self._session, address, timeout_s=timeout_s, expected=expected_peer)
        finally:
            await fresh.close()

    async def close(self) -> None:
        """Stop serving and close the client session; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.port_mapping is not None:
            await self.port_mapping.close()
        if self._tunnel is not None:
            await self._tunnel.close()
        if self.relay is not None:
            await self.relay.close()  # ends the tunnels' handlers, which would hold the shutdown
        await self.sessions.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> HttpTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- client side -------------------------------------------------------------------------

    def peer_at(self, address: str) -> str | None:
        """The proven peer id of the node at ``address`` (from a current session), if any."""
        return self.sessions.peer_at(address)

    async def call(
        self,
        address: str,
        name: str,
        payload: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ) -> Any:
        if self._session is None or self._session.closed:
            raise TransportError("transport is not started or already closed")
        body = pack(payload)
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        sent_s = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                remote, data = await self._call_once(address, name, body, expected_peer)
        except TimeoutError:
            raise RequestTimeoutError(
                f"{name} to {address} took longer than {timeout_s} s"
            ) from None
        self.counters.add_sent(remote, len(body))
        self.counters.add_recv(remote, len(data))
        self.counters.add_rpc(name, len(body), len(data))
        if max(len(body), len(data)) <= SMALL_RPC_BYTES:
            self.counters.add_rtt(remote, time.monotonic() - sent_s)
        return unpack(data, self.limits)

    async def _call_once(
        self, address: str, name: str, body: bytes, expected: str | None
    ) -> tuple[str, bytes]:
        # The handshake (when one is needed) shares the call's deadline; see ClientSessions.post.
        session, data = await self.sessions.post(
            self._session, address, f"/{API_VERSION}/rpc/{name}", body, expected=expected,
            handshake_timeout_s=self.config.request_timeout_s,
            max_answer_bytes=self.limits.max_body_bytes,
        )  # fmt: skip
        return session.peer_id, data

    def open_stream(
        self,
        address: str,
        name: str,
        header: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ) -> ClientStream:
        if self._session is None or self._session.closed:
            raise TransportError("transport is not started or already closed")
        idle_timeout_s = self.config.stream_idle_timeout_s if timeout_s is None else timeout_s
        return ClientStream(
            self._session,
            address,
            f"/{API_VERSION}/stream/{name}",
            header_bytes=pack(header),
            sessions=self.sessions,
            own_peer_id=self.peer_id,
            expected_peer=expected_peer,
            tag_frames=self.config.swarm_key is not None,
            limits=self.limits,
            counters=self.counters,
            idle_timeout_s=idle_timeout_s,
            handshake_timeout_s=min(idle_timeout_s, self.config.request_timeout_s),
        )


__all__ = [
    "BadMessageError",
    "FrameReader",
    "FrameWriter",
    "HttpTransport",
    "Refused",
    "TransportConfig",
    "status_of",
]
