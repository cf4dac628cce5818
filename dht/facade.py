"""A blocking DHT for code outside the event loop (the training loop in the main thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.kademlia.storage import ValueWithExpiration
from dht.launch import open_node
from dht.net.config import TransportConfig
from dht.reach.reachability import Reachability
from dht.runtime import EventLoopThread


class DHT:
    """A DHT node on an event-loop thread, reached through blocking calls.

    Like ``hivemind.DHT``: ``dht = DHT(...); dht.store(...); dht.get(...); dht.close()``. Several
    components of one process share the loop thread: pass the peer's ``loop_thread``.

    Args:
        identity: this node's key pair.
        transport_config: where to listen and how to reach others.
        dht_config: bootstrap peers and DHT parameters.
        loop_thread: the process's event-loop thread; one is created (and owned) when None.
        call_timeout_s: bound on each blocking call (start, store, get, close), in seconds.
        check_reachability: ask the initial peers to dial this node back when starting; one
            nobody can dial is relayed by one of them, or else runs in client mode (see
            :mod:`dht.reach.reachability`).
        relay_via: be reached through the first of these relays that accepts (URLs).
        routes: each adds its plain routes (``GET /metrics``) to the transport before it serves.
        thread_name: the name of the event-loop thread this DHT creates.
    """

    def __init__(
        self,
        *,
        identity: PeerIdentity,
        transport_config: TransportConfig,
        dht_config: DHTConfig,
        loop_thread: EventLoopThread | None = None,
        call_timeout_s: float = 60.0,
        check_reachability: bool = False,
        relay_via: Sequence[str] = (),
        routes: Iterable[Callable[[HttpTransport], None]] = (),
        thread_name: str = "vp-dht",
    ):
        self._owns_loop = loop_thread is None
        self.loop_thread = loop_thread or EventLoopThread(name=thread_name)
        self.call_timeout_s = call_timeout_s
        self._stack = AsyncExitStack()
        self._closed = False
        try:
            self.node: DHTNode = self._run(
                self._stack.enter_async_context(
                    open_node(
                        identity,
                        transport_config,
                        dht_config,
                        check_reachability=check_reachability,
                        relay_via=relay_via,
                        routes=routes,
                    )
                )
            )
        except BaseException:
            if self._owns_loop:
                self.loop_thread.close()
            raise

    def _run(self, coro) -> Any:
        return self.loop_thread.run(coro, timeout_s=self.call_timeout_s)

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def address(self) -> str | None:
        return self.node.address

    @property
    def reachability(self) -> Reachability | None:
        """What the reachability check found (None when not checked)."""
        return getattr(self.node.transport, "reachability", None)

    def store(self, key, value: Any, expiration_time: float, subkey=None) -> bool:
        """Store ``value`` until ``expiration_time`` (unix seconds); True if a replica took it."""
        return self._run(self.node.store(key, value, expiration_time, subkey=subkey))

    def get(self, key, latest: bool = False) -> ValueWithExpiration | None:
        """The value under ``key`` (a dict of subkeys for dictionary values), or None."""
        return self._run(self.node.get(key, latest=latest))

    def close(self) -> None:
        """Leave the swarm and stop the loop thread if this DHT owns it; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._stack.aclose())
        finally:
            if self._owns_loop:
                self.loop_thread.close()

    def __enter__(self) -> DHT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
