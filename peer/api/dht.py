"""``peer.DHT``: start or join a swarm from Python.

The blocking facade (:class:`dht.facade.DHT`) with the keyword arguments of ``hivemind.DHT``
where they mean the same thing. Addresses are URLs (``http://host:port``); hivemind-style
multiaddrs (``/ip4/1.2.3.4/tcp/31337``) are accepted wherever an address goes, so a script that
passes ``host_maddrs=[...]`` or ``get_visible_maddrs()`` around keeps working.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from dht.config import DHTConfig
from dht.errors import ConfigError
from dht.facade import DHT as BlockingDHT
from dht.identity import PeerIdentity, short_id
from dht.kademlia.storage import ValueWithExpiration
from dht.net.config import ReachabilityConfig, TransportConfig
from dht.options import parse_multiaddr, read_swarm_key
from dht.reach.reachability import Reachability
from peer.api.dht_args import (
    as_url,
    check_identity,
    hivemind_settings,
    initial_urls,
    listen_address,
    note_node_kwargs,
    relay_cap,
    with_hivemind_names,
)
from peer.api.futures import DHTFuture, chain
from peer.api.maddr import visible_maddrs
from peer.api.values import dht_key, dht_subkey, stored_value, user_result
from peer.profiling.prometheus import METRICS_PATH, PrometheusExporter

__all__ = ["DHT", "DHTFuture", "as_url", "parse_multiaddr"]
logger = logging.getLogger(__name__)
# Starting: bind, then reach the initial peers (their own timeouts bound each request).
START_TIMEOUT_S = 60.0


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
        source_host: local IP address its outgoing connections are made from (default: the
            system's choice).
        identity_path: Ed25519 key file, created on first use; the peer id derives from it
            (default: a fresh identity each run).
        swarm_key: shared secret of a private swarm (bytes or str); default: the environment's
            ``VP_SWARM_KEY``, else an open swarm.
        client_mode: run no server (behind a NAT): this peer calls others, nobody calls it.
            None means False, as in hivemind; a peer that its initial peers cannot dial back
            turns to client mode by itself (see :attr:`reachability`).
        start: start now (hivemind's ``start=True``); with False, :meth:`run_in_background`
            starts it.
        await_ready: with ``start``, return only once joined (False: join in the background;
            :meth:`wait_until_ready` waits, and so does every call that needs the node).
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
        **hivemind_kwargs: the arguments ``hivemind.DHT`` passes on to its node and its libp2p
            daemon: those meaning the same as one of ours set it (``wait_timeout``,
            ``bucket_size``, ``num_replicas``, ``cache_size``, ``nat_port_map``,
            ``use_relay``, ``no_listen``); the others are accepted, with one INFO line saying
            what is done instead at a non-default value (see docs/API.md).

    Raises:
        TypeError: an argument hivemind does not have either, or a value whose effect is not
            given here (``record_validators``, ``authorizer``, ``use_ipfs=True``).
        ValueError: a bad value, naming the argument.
    """

    def __init__(
        self,
        initial_peers: Sequence[Any] | None = None,
        *,
        start: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        source_host: str | None = None,
        identity_path: str | Path | None = None,
        swarm_key: bytes | str | None = None,
        client_mode: bool | None = None,
        await_ready: bool = True,
        host_maddrs: Sequence[Any] | None = None,
        announce_maddrs: Sequence[Any] | None = None,
        identity: PeerIdentity | None = None,
        serve_metrics: bool = False,
        relay: bool = True,
        max_relayed_bytes_per_s: float | None = None,
        port_mapping: bool = True,
        relay_via: Sequence[str] = (),
        **hivemind_kwargs: Any,
    ):
        dht_fields, own = hivemind_settings(dict(hivemind_kwargs))
        relay, port_mapping = own.get("relay", relay), own.get("port_mapping", port_mapping)
        client_mode = bool(client_mode) or own.get("client_mode", False)
        if isinstance(relay_via, str):
            raise ValueError("relay_via: a list of URLs, not one string")
        relay_via = [as_url(a, argument="relay_via") for a in relay_via]
        if relay_via and client_mode:
            raise ValueError("relay_via: a peer in client_mode serves nothing to relay")
        urls = initial_urls(initial_peers, argument="initial_peers")
        host, port = listen_address(host, port, host_maddrs)
        if announce_maddrs:
            parsed = [parse_multiaddr(m) for m in announce_maddrs]
            if parsed[0] is None:
                raise ValueError(f"announce_maddrs: {announce_maddrs[0]!s} is not /ip4/H/tcp/P")
            announce_host = parsed[0][0]
        if swarm_key is not None and not isinstance(swarm_key, bytes | str):
            raise ValueError(f"swarm_key: bytes or str, got {type(swarm_key).__name__}")
        key = swarm_key.encode() if isinstance(swarm_key, str) else swarm_key
        check_identity(identity, identity_path)
        if not isinstance(serve_metrics, bool):
            raise ValueError(f"serve_metrics: True or False, got {serve_metrics!r}")
        try:
            transport_config = TransportConfig(
                host=host,
                port=port,
                announce_host=announce_host,
                source_host=source_host,
                client_mode=client_mode,
                swarm_key=key if key is not None else read_swarm_key(None),
                relay_enabled=bool(relay),
                **relay_cap(max_relayed_bytes_per_s),
                reachability=ReachabilityConfig(try_port_mapping=bool(port_mapping)),
            )
            dht_config = DHTConfig(initial_peers=tuple(urls), **dht_fields)
            if identity is None:
                identity = (
                    PeerIdentity.load_or_create(Path(identity_path))
                    if identity_path is not None
                    else PeerIdentity.generate()
                )
        except ConfigError as e:  # a ValueError too; peer join's one-line errors catch this type
            raise ConfigError(with_hivemind_names(str(e), hivemind_kwargs)) from None
        # what GET /metrics shows: the attached optimizer's exporter (see attach_metrics)
        self._idle_exporter = PrometheusExporter(lambda: None, peer_id=identity.peer_id, run_id="")
        self._exporter = self._idle_exporter
        self._make_facade = partial(
            BlockingDHT,
            identity=identity,
            transport_config=transport_config,
            dht_config=dht_config,
            call_timeout_s=START_TIMEOUT_S,
            check_reachability=True,
            relay_via=tuple(relay_via),
            routes=(self._install_metrics,) if serve_metrics else (),
            thread_name=f"vp-{short_id(identity.peer_id)}",
        )
        self._facade: BlockingDHT | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._started = self._alive = False
        self._stopped = threading.Event()
        self._asked_client_mode = client_mode
        self.serves_metrics = serve_metrics and not client_mode
        self.initial_peers = urls
        self.attached_run: str | None = None  # the run of the Optimizer using this DHT
        if start:
            self.run_in_background(await_ready=await_ready)

    # ---- starting (hivemind's run_in_background / wait_until_ready) ------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start joining the swarm; with ``await_ready``, return once joined.

        Raises:
            RuntimeError: already started.
            TimeoutError: not joined within ``timeout`` seconds (it goes on joining).
            dht.errors.TransportError: none of the initial peers answered.
        """
        if self._started:
            raise RuntimeError("peer.DHT: already started")
        self._started = self._alive = True
        if await_ready and timeout is None:
            self._start_now()  # here, so that a failure is raised with its own traceback
        else:
            name = self._make_facade.keywords["thread_name"] + "-start"
            threading.Thread(target=self._start_now, name=name, daemon=True).start()
        if await_ready:
            self.wait_until_ready(timeout)

    def _start_now(self) -> None:
        try:
            self._facade = self._make_facade()
        except BaseException as e:
            self._alive = False
            self._ready.set_exception(e)
            if isinstance(e, Exception):
                return
            raise
        self._ready.set_result(None)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until this DHT has joined (raises what starting raised).

        Raises:
            RuntimeError: not started (``start=False`` and no :meth:`run_in_background`).
            TimeoutError: not joined within ``timeout`` seconds.
        """
        if not self._started:
            raise RuntimeError("peer.DHT: not started; call run_in_background()")
        self._ready.result(timeout)

    def run(self) -> None:
        """hivemind's blocking variant: start (unless started) and serve until
        :meth:`shutdown` is called from another thread."""
        if not self._started:
            self.run_in_background(await_ready=True)
        self.wait_until_ready()
        self._stopped.wait()

    def _joined(self) -> BlockingDHT:
        self.wait_until_ready()
        return self._facade

    # ---- who this peer is --------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        """This peer's id (derived from its Ed25519 public key)."""
        return self._joined().peer_id

    @property
    def client_mode(self) -> bool:
        """Whether this peer serves nothing: asked, or found not reachable when starting."""
        return self._asked_client_mode or self._joined().address is None

    @property
    def address(self) -> str | None:
        """The URL this peer serves on; None in client mode."""
        return self._joined().address

    @property
    def reachability(self) -> Reachability | None:
        """Whether the swarm can dial this peer, as its initial peers found when it started
        (``reachable``: True, False, or None when not checked; ``address``; ``observed_host``);
        a peer found not reachable runs in client mode (:attr:`client_mode` is then True)."""
        return self._joined().reachability

    @property
    def urls(self) -> list[str]:
        """What others pass as ``initial_peers`` to join through this peer (empty in client
        mode: pass the ones this peer joined through)."""
        return [self.address] if self.address else []

    def get_visible_maddrs(self, latest: bool = False) -> list[Any]:
        """:attr:`urls` as multiaddrs (``/ip4/HOST/tcp/PORT``), of the class hivemind's helpers
        take (see :mod:`peer.api.maddr`); ``initial_peers`` takes them back. A relayed peer
        gives its relay's address, through which the swarm is joined."""
        del latest  # the address does not change while the DHT runs
        return visible_maddrs(self.urls)

    # ---- the facade's parts, for the optimizer --------------------------------------------

    @property
    def node(self):
        """The :class:`dht.kademlia.node.DHTNode` (on :attr:`loop_thread`)."""
        return self._joined().node

    @property
    def loop_thread(self):
        """The event-loop thread the node runs on."""
        return self._joined().loop_thread

    # ---- hivemind's store / get / run_coroutine ---------------------------------------------

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
        **kwargs: Any,
    ) -> bool | DHTFuture:
        """Store ``value`` until ``expiration_time`` (DHT time, :func:`dht.config.get_dht_time`,
        seconds); True if a replica took it. Keys, subkeys and values as hivemind's (see
        :mod:`peer.api.values`: tuples stay tuples).

        Args:
            key: a msgpack-serializable key.
            value: a msgpack-serializable value.
            expiration_time: when it expires.
            subkey: set this entry of a dictionary value instead of replacing the value.
            return_future: return a :class:`DHTFuture` at once instead of the result.
            **kwargs: hivemind's ``DHTNode.store_many`` options (one INFO line; no effect).
        """
        note_node_kwargs("store", kwargs)
        coro = self.node.store(
            dht_key(key), stored_value(value), expiration_time, subkey=dht_subkey(subkey)
        )
        return self._call(coro, return_future)

    def get(
        self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any
    ) -> ValueWithExpiration | DHTFuture | None:
        """``(value, expiration_time)`` under ``key`` (a ``ValueWithExpiration``), or None; a
        dictionary value is ``{subkey: (value, expiration_time)}``.

        Args:
            key: the key it was stored under.
            latest: ask the replicas for the newest version instead of the first found.
            return_future: return a :class:`DHTFuture` at once instead of the result.
            **kwargs: hivemind's ``DHTNode.get_many`` options (one INFO line; no effect).
        """
        note_node_kwargs("get", kwargs)

        async def get() -> ValueWithExpiration | None:
            return user_result(await self.node.get(dht_key(key), latest=latest))

        return self._call(get(), return_future)

    def run_coroutine(self, coro: Callable[[DHT, Any], Any], return_future: bool = False) -> Any:
        """Run ``await coro(self, node)`` on this DHT's event loop (``node``: our
        :class:`dht.kademlia.node.DHTNode`, whose ``get`` and ``store`` take what this DHT's
        do, keys and values as the node's); its result, or a :class:`DHTFuture`."""
        return self._call(coro(self, self.node), return_future)

    def _call(self, coro, return_future: bool) -> Any:
        facade = self._joined()
        if return_future:
            return chain(facade.loop_thread.submit(coro))
        return facade.loop_thread.run(coro, timeout_s=facade.call_timeout_s)

    def add_validators(self, record_validators: Sequence[Any]) -> None:
        """hivemind's record validators are not supported (records under owner subkeys are
        signed by their writer); an empty list is accepted.

        Raises:
            TypeError: a non-empty ``record_validators``.
        """
        if list(record_validators):
            raise TypeError(
                "add_validators(): hivemind's record validators are not supported here; "
                "records under owner subkeys are signed by their writer"
            )

    def attach_metrics(self, exporter: PrometheusExporter | None) -> None:
        """What ``GET /metrics`` answers from now on (None: only ``vp_peer_info``); the
        optimizer using this DHT sets it."""
        self._exporter = exporter if exporter is not None else self._idle_exporter

    def _install_metrics(self, transport) -> None:
        transport.add_http_get(METRICS_PATH, lambda: self._exporter.render())

    # ---- leaving -------------------------------------------------------------------------

    def is_alive(self) -> bool:
        """Whether the DHT runs or is starting (started, not shut down, did not fail)."""
        return self._alive

    def shutdown(self) -> None:
        """Leave the swarm and stop the network thread; safe to call twice."""
        self._alive = False
        self._stopped.set()
        if not self._started:
            return
        try:
            self._ready.result()  # a DHT still joining leaves once joined
        except Exception:
            return  # it never started: nothing to close
        self._facade.close()

    def __enter__(self) -> DHT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        if not self._ready.done() or self._ready.exception() is not None:
            return "peer.DHT(not running)"
        return f"peer.DHT(peer_id={self.peer_id[:8]!r}, address={self.address!r})"
