"""Settings of the aiohttp transport."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path

from dht.errors import ConfigError
from dht.net.wire import MessageLimits


@dataclass(frozen=True, kw_only=True)
class PortMappingConfig:
    """How a node asks its gateway for a port mapping.

    Attributes:
        discovery_timeout_s: wait for a gateway to answer the SSDP search, in seconds; all
            that a network without one costs.
        request_timeout_s: bound on each request to the gateway (its description, each
            action), in seconds.
        lease_s: lifetime the mapping is asked for, in seconds (renewed at half of it); a
            peer that crashed leaves it open at most this long.
        num_port_attempts: external ports tried: the listening port first, then random
            dynamic ports (another host of the LAN may hold the same one).
        description: the mapping's name in the router's table.
    """

    discovery_timeout_s: float = 2.0
    request_timeout_s: float = 5.0
    lease_s: int = 3600
    num_port_attempts: int = 3
    description: str = "volunteer-peer"

    def __post_init__(self) -> None:
        for name in ("discovery_timeout_s", "request_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if self.lease_s < 2:
            raise ConfigError(f"lease_s must be >= 2, got {self.lease_s}")
        if self.num_port_attempts < 1:
            raise ConfigError(f"num_port_attempts must be >= 1, got {self.num_port_attempts}")


@dataclass(frozen=True, kw_only=True)
class ReachabilityConfig:
    """How a node answers dial-backs and checks its own reachability.

    Attributes:
        dial_back_timeout_s: bound on dialling a caller back (connect and handshake), in
            seconds.
        max_dial_backs_per_s_per_address: sustained dial-backs served per source IP, per second.
        dial_back_burst: dial-backs one source IP may ask for at once before that rate applies.
        max_concurrent_dial_backs: dial-backs in progress at once, all callers together.
        num_peers_asked: distinct initial peers a joining node asks at once.
        check_timeout_s: bound on the whole check, every peer asked and retried, in seconds;
            more than ``dial_back_timeout_s``.
        try_port_mapping: a node nobody can dial asks its gateway to forward its port (UPnP)
            before it is relayed; False: never.
        port_mapping: discovery and request timeouts and the lease of that mapping.
    """

    dial_back_timeout_s: float = 5.0
    max_dial_backs_per_s_per_address: float = 1.0
    dial_back_burst: int = 20
    max_concurrent_dial_backs: int = 64
    num_peers_asked: int = 3
    check_timeout_s: float = 10.0
    try_port_mapping: bool = True
    port_mapping: PortMappingConfig = field(default_factory=PortMappingConfig)

    def __post_init__(self) -> None:
        for name in ("dial_back_timeout_s", "max_dial_backs_per_s_per_address", "check_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be positive and finite, got {getattr(self, name)}")
        for name in ("dial_back_burst", "max_concurrent_dial_backs", "num_peers_asked"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.check_timeout_s <= self.dial_back_timeout_s:
            raise ConfigError(
                f"check_timeout_s ({self.check_timeout_s}) must exceed dial_back_timeout_s "
                f"({self.dial_back_timeout_s})"
            )


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Where a node listens, how it is reached, and what it accepts.

    Attributes:
        host: interface to listen on.
        port: TCP port; 0 picks a free one.
        announce_host: host others should use to reach this node; defaults to ``host``, or to
            the address of the default route's interface when ``host`` is a wildcard.
        source_host: the local IP address this node's outgoing connections are made from
            (None: the operating system picks one). A host with several addresses can pin
            one; ``peer bench swarm`` gives each light peer an address of its own on loopback
            (``127.x.y.z``), so that every node's limits per source address see one peer
            each, as on the internet, not the whole swarm as one address.
        client_mode: run no server (a peer behind NAT); it can still call others.
        reachability: how this node answers dial-backs and checks its own reachability.
        swarm_key: shared secret; when set, only members can make a session (the handshake
            carries an HMAC under it and it salts every session key) and stream frames carry
            tags. Identity is proven with or without it.
        tls_cert_file: PEM certificate to serve HTTPS with (needs ``tls_key_file``).
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_ca_file: PEM CA bundle to verify other nodes' HTTPS certificates with.
        request_timeout_s: bound on one RPC (send, remote work, answer), in seconds.
        connect_timeout_s: bound on opening a TCP (and TLS) connection, in seconds.
        stream_idle_timeout_s: bound on each wait for the next frame of a stream, in seconds.
        stream_write_timeout_s: bound on each write of a stream's reply, in seconds: a
            receiver that stops reading has its connection cut once a write waited this long
            (checked every half of it, so within 1.5 times it).
        max_streams_per_peer: concurrent streams accepted from one proven peer id.
        max_streams_per_address: concurrent streams accepted from one source IP address (an
            IPv6 /64 counts as one); a stream relayed to this node counts under the caller's
            address its relay passed (``relayed/{address}``, a key of its own). Streams are
            shared fairly by addresses once ``max_connections`` of them are open: a newcomer
            address's stream cancels the oldest of an address over its fair share.
        replay_window_s: accepted distance of a request's timestamp from this node's clock,
            in seconds.
        max_remembered_nonces: the most (sender, nonce) pairs remembered against replays.
        session_lifetime_s: how long a session made by the handshake is good for, in seconds.
        max_handshakes_per_s_per_address: sustained rate of handshakes accepted from one
            source address (an IPv6 /64), per second (each costs a signature check); beyond it
            429 with a ``Retry-After``. Each handshake also counts as a request of its
            address's share (``max_requests_per_s_per_address``).
        handshake_burst: handshakes one source address may make at once before that rate
            applies.
        max_requests_per_s_per_peer: requests (RPCs, streams) one proven peer id may make per
            second, sustained; beyond it a request is refused (429 with a ``Retry-After``)
            before its body is read.
        request_burst_per_peer: requests one proven peer id may make at once before that rate
            applies.
        max_requests_per_s_per_address: requests one source address (an IPv6 /64) may make per
            second, all its peer ids together, checked before a request is authenticated,
            while another address made a request within ``request_contention_window_s`` (an
            address alone, say a swarm on one host, may use the whole node); a request relayed
            to this node counts under the caller's address its relay passed
            (``relayed/{address}``, a key of its own: see :mod:`dht.reach.relay_server`), and
            at the relay under the caller's own address.
        request_burst_per_address: requests one source address may make at once before that
            rate applies.
        request_contention_window_s: see ``max_requests_per_s_per_address``, in seconds.
        request_body_bytes_per_request: a request's body (or stream header) counts as one more
            request of those shares per this many bytes that arrived (its parsing and handling
            cost the node about in proportion), in bytes.
        max_refusal_hold_s: a sender refused for its rate (or its share of a pool) that sends
            again before the ``Retry-After`` it was told waits for that refusal until then, at
            most this long, in seconds (each of its connections then costs the node at most one
            refusal per hold).
        max_connections: TCP connections the server keeps open at once; more are closed at once,
            except that while all are open, an address holding fewer than its fair share
            (``max(1, max_connections / addresses holding or asking)``) gets one and the oldest
            connection of an address over its share is aborted (``dht.net.shares.FairSlots``).
        max_connections_per_address: TCP connections kept open at once from one source address
            (an IPv6 /64 counts as one); more are closed at once.
        max_connection_accepts_per_s_per_address: new TCP connections accepted from one source
            address (an IPv6 /64) per second, sustained, while another address made a request
            or a connection within ``request_contention_window_s`` (an address alone, say a
            swarm on one host, is never refused for it); beyond it a new connection is closed
            at once, before a byte of it is parsed: a sender that hangs up after each refusal
            and comes back costs the node no more than this.
        connection_accept_burst_per_address: new connections one source address may open at
            once before that rate applies.
        idle_connection_timeout_s: a connection with no request in progress (including one
            still sending its request headers) is closed after this long, in seconds.
        client_keepalive_s: an idle connection this node opened is kept this long for its
            next request to the same node, in seconds; below the other nodes'
            ``idle_connection_timeout_s`` (30 s by default), so that the client closes it
            before a request of its own can meet the server's close. Kept 15 s (aiohttp's
            default), 256 light peers opened a connection for every 1.9 requests; kept 25 s,
            for every 3.4 (``peer bench swarm --peers 256``, docs/BENCHMARKS.md).
        max_header_fields: the most HTTP header fields a request may have.
        max_header_field_bytes: the longest HTTP header line accepted, in bytes.
        max_body_bytes_in_flight: request bytes (bodies, stream header frames) being received
            at once across all requests before their digest is checked, in bytes; a request
            that does not fit is refused (503) instead of buffered. Bytes are charged as they
            arrive, never for the announced length.
        max_body_bytes_in_flight_per_peer: the share of ``max_body_bytes_in_flight`` one proven
            peer id may hold, in bytes (beyond it, its request is refused: 503).
        max_body_bytes_in_flight_per_address: the share one source address (an IPv6 /64) may
            hold, in bytes.
        body_stall_timeout_s: a request body (or stream header frame) from which no byte arrived
            for this long is refused (408) and what it held given back, in seconds.
        relay_enabled: relay for peers that others cannot reach (when this node serves: not in
            client mode): they attach over a WebSocket and are reached at
            ``{this node's URL}/v2/relay/{peer id}``.
        max_relayed_peers: the most peers attached to this relay at once; more are refused (503),
            except that while all are attached, an address holding fewer than its fair share of
            them (``max(1, max_relayed_peers / addresses holding or asking)``) gets the seat of
            an address over its share (that tunnel is closed).
        max_relayed_bytes_per_s: the relayed bytes (both ways, all relayed peers together) this
            relay forwards per second, in bytes per second (a token bucket holding one second of
            them): transfers in progress slow down to it, new relayed requests are refused
            (503) while it is spent.
        max_relayed_requests_per_peer: requests forwarded to one relayed peer at once; while all
            are in use, an address holding fewer than its fair share of them gets the slot of
            an address over its share (that request is reset: 429 with ``Retry-After``), and
            any other is refused (429 with ``Retry-After``).
        max_relayed_bytes_per_s_per_address: the share of ``max_relayed_bytes_per_s`` of one
            caller address (an IPv6 /64), in bytes per second: its transfers slow down to it,
            and its new requests (only its) are refused (503) while its bucket is spent; None
            is a quarter of ``max_relayed_bytes_per_s``.
        max_relayed_peers_per_address: peers attached to this relay at once from one source
            address (503 beyond).
        max_relayed_requests_per_address: requests forwarded at once to one relayed peer from
            one caller address (beyond: 429 with a ``Retry-After``, and the address's bucket of
            requests, ``max_requests_per_s_per_address``, is emptied).
        relay_heartbeat_s: a relay tunnel is pinged every this many seconds, in seconds, at both
            ends; a tunnel without an answer for half of it more is closed (so a dead relay is
            noticed within 1.5 times it).
        relay_attach_timeout_s: bound on one attempt to attach to a relay, in seconds.
        relay_retry_s: pause between two rounds of attempts over all relay candidates, in
            seconds, when none accepted.
        limits: sizes and nesting accepted in messages and frames.
    """

    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    source_host: str | None = None
    client_mode: bool = False
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    swarm_key: bytes | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    stream_idle_timeout_s: float = 30.0
    stream_write_timeout_s: float = 30.0
    max_streams_per_peer: int = 8
    max_streams_per_address: int = 64
    replay_window_s: float = 30.0
    max_remembered_nonces: int = 100_000
    session_lifetime_s: float = 600.0
    max_handshakes_per_s_per_address: float = 50.0
    handshake_burst: int = 200
    max_requests_per_s_per_peer: float = 200.0
    request_burst_per_peer: int = 200
    max_requests_per_s_per_address: float = 200.0
    request_burst_per_address: int = 200
    request_contention_window_s: float = 10.0
    request_body_bytes_per_request: int = 4096
    max_refusal_hold_s: float = 1.0
    max_connections: int = 1024
    max_connections_per_address: int = 256
    max_connection_accepts_per_s_per_address: float = 20.0
    connection_accept_burst_per_address: int = 100
    idle_connection_timeout_s: float = 30.0
    client_keepalive_s: float = 25.0
    max_header_fields: int = 32
    max_header_field_bytes: int = 4096
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    max_body_bytes_in_flight_per_peer: int = 8 * 1024 * 1024
    max_body_bytes_in_flight_per_address: int = 16 * 1024 * 1024
    body_stall_timeout_s: float = 5.0
    relay_enabled: bool = True
    max_relayed_peers: int = 32
    max_relayed_bytes_per_s: float = 12.5e6
    max_relayed_requests_per_peer: int = 16
    max_relayed_bytes_per_s_per_address: float | None = None
    max_relayed_peers_per_address: int = 4
    max_relayed_requests_per_address: int = 8
    relay_heartbeat_s: float = 10.0
    relay_attach_timeout_s: float = 10.0
    relay_retry_s: float = 2.0
    limits: MessageLimits = field(default_factory=MessageLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "stream_idle_timeout_s",
            "stream_write_timeout_s",
            "replay_window_s",
            "session_lifetime_s",
            "max_handshakes_per_s_per_address",
            "max_requests_per_s_per_peer",
            "max_requests_per_s_per_address",
            "max_refusal_hold_s",
            "request_contention_window_s",
            "max_connection_accepts_per_s_per_address",
            "idle_connection_timeout_s",
            "client_keepalive_s",
            "max_relayed_bytes_per_s",
            "relay_heartbeat_s",
            "relay_attach_timeout_s",
            "relay_retry_s",
            "body_stall_timeout_s",
        ):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be positive and finite, got {getattr(self, name)}")
        for name in (
            "max_streams_per_peer",
            "max_streams_per_address",
            "max_remembered_nonces",
            "handshake_burst",
            "request_burst_per_peer",
            "request_burst_per_address",
            "request_body_bytes_per_request",
            "max_connections",
            "max_connections_per_address",
            "connection_accept_burst_per_address",
            "max_header_fields",
            "max_header_field_bytes",
            "max_body_bytes_in_flight",
            "max_relayed_peers",
            "max_relayed_requests_per_peer",
            "max_relayed_peers_per_address",
            "max_relayed_requests_per_address",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_body_bytes_in_flight",
            "max_body_bytes_in_flight_per_peer",
            "max_body_bytes_in_flight_per_address",
        ):
            if getattr(self, name) < self.limits.max_body_bytes:
                raise ConfigError(
                    f"{name} ({getattr(self, name)}) must be at least "
                    f"limits.max_body_bytes ({self.limits.max_body_bytes})"
                )
        per_address = self.max_relayed_bytes_per_s_per_address
        if per_address is not None and not 0 < per_address < float("inf"):
            raise ConfigError(
                "max_relayed_bytes_per_s_per_address must be positive and finite, "
                f"got {per_address}"
            )
        if self.source_host is not None:
            try:
                ipaddress.ip_address(self.source_host)
            except ValueError:
                raise ConfigError(
                    f"source_host must be an IP address, got {self.source_host!r}"
                ) from None
        if self.swarm_key is not None and len(self.swarm_key) < 16:
            raise ConfigError("swarm_key must be at least 16 bytes")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file must be given together")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path}")

    def relayed_bytes_per_s_per_address(self) -> float:
        """One caller address's share of the relayed bytes per second."""
        if self.max_relayed_bytes_per_s_per_address is None:
            return self.max_relayed_bytes_per_s / 4
        return self.max_relayed_bytes_per_s_per_address

    def announced_host(self) -> str:
        """The host part of this node's URL."""
        host = self.announce_host or self.host
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            return host
        if wildcard:
            host = _default_route_ip()
        return f"[{host}]" if ":" in host else host


def _default_route_ip() -> str:
    # connect() on a UDP socket sends nothing; it only asks the kernel which interface it would use.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
