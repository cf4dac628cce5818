"""Settings of the aiohttp transport."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path

from dht.errors import ConfigError
from dht.wire import MessageLimits


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Where a node listens, how it is reached, and what it accepts.

    Attributes:
        host: interface to listen on.
        port: TCP port; 0 picks a free one.
        announce_host: host others should use to reach this node; defaults to ``host``, or to
            the address of the default route's interface when ``host`` is a wildcard.
        client_mode: run no server (a peer behind NAT); it can still call others.
        swarm_key: shared secret; when set, every request, response and stream frame carries
            an HMAC under it and anything without a valid one is refused.
        tls_cert_file: PEM certificate to serve HTTPS with (needs ``tls_key_file``).
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_ca_file: PEM CA bundle to verify other nodes' HTTPS certificates with.
        request_timeout_s: bound on one RPC (send, remote work, answer), in seconds.
        connect_timeout_s: bound on opening a TCP (and TLS) connection, in seconds.
        stream_idle_timeout_s: bound on each wait for the next frame of a stream, in seconds.
        max_streams_per_peer: concurrent streams accepted from one sender.
        replay_window_s: accepted distance of a request's timestamp from this node's clock.
        limits: sizes and nesting accepted in messages and frames.
    """

    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    client_mode: bool = False
    swarm_key: bytes | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    stream_idle_timeout_s: float = 30.0
    max_streams_per_peer: int = 8
    replay_window_s: float = 30.0
    limits: MessageLimits = field(default_factory=MessageLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "stream_idle_timeout_s",
            "replay_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_streams_per_peer < 1:
            raise ConfigError(f"max_streams_per_peer must be >= 1, got {self.max_streams_per_peer}")
        if self.swarm_key is not None and len(self.swarm_key) < 16:
            raise ConfigError("swarm_key must be at least 16 bytes")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file must be given together")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path}")

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
