"""``peer.DHT``: start or join a swarm from Python.

The blocking facade (:class:`dht.facade.DHT`) with the keyword arguments of ``hivemind.DHT``
where they mean the same thing. Addresses are URLs (``http://host:port``); hivemind-style
multiaddrs (``/ip4/1.2.3.4/tcp/31337``) are accepted wherever an address goes, so a script that
passes ``host_maddrs=[...]`` or ``get_visible_maddrs()`` around keeps working.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dht.config import DHTConfig
from dht.errors import ConfigError
from dht.facade import DHT as BlockingDHT
from dht.identity import PeerIdentity, short_id
from dht.kademlia.storage import ValueWithExpiration
from dht.net.config import ReachabilityConfig, TransportConfig
from dht.options import peer_url, read_swarm_key
from dht.reach.reachability import Reachability
from peer.api.errors import UNSUPPORTED_DHT, reject_unsupported
from peer.profiling.prometheus import METRICS_PATH, PrometheusExporter

_MULTIADDR = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(/.*)?$")
# Starting: bind, then reach the initial peers (their own timeouts bound each request).
START_TIMEOUT_S = 60.0


def parse_multiaddr(addr: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``/ip4/HOST/tcp/PORT[/...]`` (ip6, dns too), or None if not one."""
    match = _MULTIADDR.match(str(addr))
    return (match.group(2), int(match.group(3))) if match else None


def as_url(addr: Any, *, argument: str) -> str:
    """An initial peer as a URL; a multiaddr becomes ``http://host:port``.

    Raises:
        ValueError: naming ``argument``, when it is neither.
    """
    parsed = parse_multiaddr(str(addr))
    if parsed is not None:
        host, port = parsed
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        return peer_url(str(addr))
    except ValueError as e:
        raise ValueError(f"{argument}: {e}") from None


class DHT:
    """A peer's node in the swarm's DHT, started when constructed; ``with`` closes it.

    Example::

        with peer.DHT(initial_peers=["http://10.0.0.1:31337"], host="0.0.0.0", port=0) as dht:
            print("others join with initial_peers=", dht.urls)

    Args:
        initial_peers: URLs (``http://host:port``) of peers already in the swarm; none to start
            a new swarm. hivemind multiaddrs with a TCP port are accepted too.
        host: interface to listen on.
        port: TCP port; 0 picks a free one.
        announce_host: host others use to reach this peer (default: ``host``).
        identity_path: Ed25519 key file, created on first use; the peer id derives from it
            (default: a fresh identity each run).
        swarm_key: shared secret of a private swarm (bytes or str); default: the environment's
            ``VP_SWARM_KEY``, else an open swarm.
        client_mode: run no server (behind a NAT): this peer calls others, nobody calls it.
            None means False, as in hivemind; a peer that its initial peers cannot dial back
            turns to client mode by itself (see :attr:`reachability`).
        start: must be True (hivemind's default use); this DHT starts when constructed.
        host_maddrs: hivemind's way to say ``host``/``port``: ``["/ip4/0.0.0.0/tcp/0"]``.
        announce_maddrs: hivemind's way to say ``announce_host``.
        identity: an Ed25519 identity already in memory (a ``dht.identity.PeerIdentity``),
            instead of ``identity_path``.
        serve_metrics: serve ``GET /metrics`` (Prometheus text) on this peer's port: the
            counters of the :class:`peer.Optimizer` using this DHT (only ``vp_peer_info``
            while none is). Nothing is proven on that path (scrapers cannot sign); it shows
            counters only. Ignored in client mode (nothing is served).
        relay: relay for peers that nobody can dial (behind NAT) when this one is reachable.
        max_relayed_bytes_per_s: cap on the bytes per second this peer relays (default: the
            transport's, 12.5e6).
        port_mapping: a peer that its initial peers cannot dial back asks its home router to
            forward its port (UPnP) before it is relayed (see :mod:`dht.reach.port_mapping`); the
            mapping is deleted at :meth:`shutdown`. Never for a loopback ``host``.
        relay_via: be reached through the first of these relays (URLs of reachable peers) that
            accepts, without asking anyone to dial back. By default a peer that its initial
            peers cannot dial back is relayed by one of them (or, if none accepts, runs in
            client mode).
        **hivemind_kwargs: hivemind arguments with no equivalent; a value other than
            hivemind's default raises :class:`TypeError` (see docs/API.md).

    Raises:
        TypeError: an argument that does not exist here.
        ValueError: a bad value, naming the argument.
    """

    def __init__(
        self,
        initial_peers: Sequence[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        identity_path: str | Path | None = None,
        swarm_key: bytes | str | None = None,
        client_mode: bool | None = None,
        start: bool = True,
        host_maddrs: Sequence[str] | None = None,
        announce_maddrs: Sequence[str] | None = None,
        identity: PeerIdentity | None = None,
        serve_metrics: bool = False,
        relay: bool = True,
        max_relayed_bytes_per_s: float | None = None,
        port_mapping: bool = True,
        relay_via: Sequence[str] = (),
        **hivemind_kwargs: Any,
    ):
        reject_unsupported("peer.DHT", hivemind_kwargs, UNSUPPORTED_DHT)
        if start is not True:
            raise TypeError(
                "peer.DHT(): start=False is not supported here; the DHT starts when constructed "
                "(create it where hivemind calls run_in_background())"
            )
        if isinstance(initial_peers, str):
            raise ValueError("initial_peers: a list of URLs, not one string")
        if isinstance(relay_via, str):
            raise ValueError("relay_via: a list of URLs, not one string")
        relay_via = [as_url(a, argument="relay_via") for a in relay_via]
        if relay_via and client_mode:
            raise ValueError("relay_via: a peer in client_mode serves nothing to relay")
        urls = [as_url(a, argument="initial_peers") for a in initial_peers or ()]
        host, port = _listen_address(host, port, host_maddrs)
        if announce_maddrs:
            parsed = parse_multiaddr(announce_maddrs[0])
            if parsed is None:
                raise ValueError(f"announce_maddrs: {announce_maddrs[0]!r} is not /ip4/H/tcp/P")
            announce_host = parsed[0]
        if swarm_key is not None and not isinstance(swarm_key, bytes | str):
            raise ValueError(f"swarm_key: bytes or str, got {type(swarm_key).__name__}")
        key = swarm_key.encode() if isinstance(swarm_key, str) else swarm_key
        _check_identity(identity, identity_path)
        if not isinstance(serve_metrics, bool):
            raise ValueError(f"serve_metrics: True or False, got {serve_metrics!r}")
        try:
            transport_config = TransportConfig(
                host=host,
                port=port,
                announce_host=announce_host,
                client_mode=bool(client_mode),
                swarm_key=key if key is not None else read_swarm_key(None),
                relay_enabled=bool(relay),
                **_relay_cap(max_relayed_bytes_per_s),
                reachability=ReachabilityConfig(try_port_mapping=bool(port_mapping)),
            )
            if identity is None:
                identity = (
                    PeerIdentity.load_or_create(Path(identity_path))
                    if identity_path is not None
                    else PeerIdentity.generate()
                )
        except ConfigError as e:  # a ValueError too; peer join's one-line errors catch this type
            raise ConfigError(str(e)) from None
        # what GET /metrics shows: the attached optimizer's exporter (see attach_metrics)
        self._idle_exporter = PrometheusExporter(lambda: None, peer_id=identity.peer_id, run_id="")
        self._exporter = self._idle_exporter
        self._facade = BlockingDHT(
            identity=identity,
            transport_config=transport_config,
            dht_config=DHTConfig(initial_peers=tuple(urls)),
            call_timeout_s=START_TIMEOUT_S,
            check_reachability=True,
            relay_via=tuple(relay_via),
            routes=(self._install_metrics,) if serve_metrics else (),
            thread_name=f"vp-{short_id(identity.peer_id)}",
        )
        self.serves_metrics = serve_metrics and not client_mode
        self.initial_peers = urls
        # a peer nobody could dial back runs in client mode, whatever was asked
        self.client_mode = bool(client_mode) or self._facade.address is None
        self._alive = True
        self.attached_run: str | None = None  # the run of the Optimizer using this DHT

    # ---- who this peer is --------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        """This peer's id (derived from its Ed25519 public key)."""
        return self._facade.peer_id

    @property
    def address(self) -> str | None:
        """The URL this peer serves on; None in client mode."""
        return self._facade.address

    @property
    def reachability(self) -> Reachability | None:
        """Whether the swarm can dial this peer, as its initial peers found when it started
        (``reachable``: True, False, or None when not checked; ``address``; ``observed_host``);
        a peer found not reachable runs in client mode (:attr:`client_mode` is then True)."""
        return self._facade.reachability

    @property
    def urls(self) -> list[str]:
        """What others pass as ``initial_peers`` to join through this peer (empty in client
        mode: pass the ones this peer joined through)."""
        return [self.address] if self.address else []

    def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        """hivemind's name for :attr:`urls` (URLs here, which ``initial_peers`` accepts)."""
        del latest  # our address does not change while the DHT runs
        return self.urls

    # ---- the facade's parts, for the optimizer --------------------------------------------

    @property
    def node(self):
        """The :class:`dht.kademlia.node.DHTNode` (on :attr:`loop_thread`)."""
        return self._facade.node

    @property
    def loop_thread(self):
        """The event-loop thread the node runs on."""
        return self._facade.loop_thread

    def store(self, key, value: Any, expiration_time: float, subkey=None) -> bool:
        """Store ``value`` until ``expiration_time`` (DHT time, seconds); True if a replica
        took it (as ``hivemind.DHT.store``)."""
        return self._facade.store(key, value, expiration_time, subkey=subkey)

    def get(self, key, latest: bool = False) -> ValueWithExpiration | None:
        """The value under ``key`` (a dict of subkeys for dictionary values), or None."""
        return self._facade.get(key, latest=latest)

    def attach_metrics(self, exporter: PrometheusExporter | None) -> None:
        """What ``GET /metrics`` answers from now on (None: only ``vp_peer_info``); the
        optimizer using this DHT sets it."""
        self._exporter = exporter if exporter is not None else self._idle_exporter

    def _install_metrics(self, transport) -> None:
        transport.add_http_get(METRICS_PATH, lambda: self._exporter.render())

    def is_alive(self) -> bool:
        """Whether the DHT still runs (not shut down)."""
        return self._alive

    def shutdown(self) -> None:
        """Leave the swarm and stop the network thread; safe to call twice."""
        self._alive = False
        self._facade.close()

    def __enter__(self) -> DHT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"peer.DHT(peer_id={self.peer_id[:8]!r}, address={self.address!r})"


def _relay_cap(max_relayed_bytes_per_s: float | None) -> dict[str, float]:
    """The transport's keyword for the relay cap (none: the transport's default)."""
    if max_relayed_bytes_per_s is None:
        return {}
    return {"max_relayed_bytes_per_s": max_relayed_bytes_per_s}


def _check_identity(identity: Any, identity_path: Any) -> None:
    if identity is None:
        return
    if not isinstance(identity, PeerIdentity):
        raise ValueError(f"identity: a dht.identity.PeerIdentity, got {type(identity).__name__}")
    if identity_path is not None:
        raise ValueError("identity: give identity or identity_path, not both")


def _listen_address(host: str, port: int, host_maddrs: Sequence[str] | None) -> tuple[str, int]:
    if host_maddrs:
        parsed = parse_multiaddr(host_maddrs[0])
        if parsed is None:
            raise ValueError(f"host_maddrs: {host_maddrs[0]!r} is not /ip4/HOST/tcp/PORT")
        host, port = parsed
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port: an integer in 0..65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host: an interface name or address, got {host!r}")
    return host, port
