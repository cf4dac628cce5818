"""An in-memory :class:`dht.net.transport.Transport`, for simulating thousands of nodes in one
process.

A :class:`MemoryNetwork` routes calls by address (``mem://N``) between the
:class:`MemoryTransport` objects registered on it. Payloads go through ``pack``/``unpack`` under
the same limits as the wire, so handlers see exactly what a socket would deliver, and refusals
map to the same statuses as over HTTP. Each leg of a call waits a base latency plus uniform
jitter; a call may be dropped (the caller then waits for its timeout); a killed node refuses
connections. Streams are not simulated.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

from dht.errors import (
    AuthError,
    BadMessageError,
    BusyError,
    ConfigError,
    DHTError,
    RemoteError,
    RequestTimeoutError,
    TransportError,
    ValidationError,
    WrongPeerError,
)
from dht.net.transport import ByteCounters, RequestContext, RpcHandler, StreamHandler
from dht.net.wire import MessageLimits, pack, unpack

logger = logging.getLogger(__name__)

_STATUS_OF = ((BadMessageError, 400), (AuthError, 401), (ValidationError, 422), (BusyError, 429))


@dataclass(frozen=True, kw_only=True)
class LatencyModel:
    """Delays and losses of a simulated network.

    Attributes:
        base_s: one-way delay of every message, in seconds.
        jitter_s: extra one-way delay drawn uniformly from ``[0, jitter_s]``, in seconds.
        drop_probability: chance that a call is lost (its caller waits for the timeout).
    """

    base_s: float = 0.0
    jitter_s: float = 0.0
    drop_probability: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "jitter_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.drop_probability < 1:
            raise ConfigError(f"drop_probability must be in [0, 1), got {self.drop_probability}")


class MemoryNetwork:
    """Routes calls between in-memory transports by address.

    Args:
        latency: delays and losses applied to every call.
        seed: seeds the latency and loss draws.
    """

    def __init__(self, latency: LatencyModel | None = None, *, seed: int | None = None):
        self.latency = latency or LatencyModel()
        self.num_calls = 0
        self._rng = random.Random(seed)
        self._nodes: dict[str, MemoryTransport] = {}
        self._next_index = 0

    def register(self, transport: MemoryTransport) -> str:
        address = f"mem://{self._next_index}"
        self._next_index += 1
        self._nodes[address] = transport
        return address

    def unregister(self, address: str) -> None:
        self._nodes.pop(address, None)

    def kill(self, address: str) -> None:
        """Make ``address`` unreachable at once, as if its process died."""
        transport = self._nodes.pop(address, None)
        if transport is not None:
            transport.killed = True

    def is_alive(self, address: str) -> bool:
        return address in self._nodes

    def _delay_s(self) -> float:
        lat = self.latency
        return lat.base_s + (self._rng.uniform(0, lat.jitter_s) if lat.jitter_s else 0.0)

    async def _leg(self) -> None:
        delay_s = self._delay_s()
        if delay_s > 0:
            await asyncio.sleep(delay_s)

    def node_at(self, address: str) -> MemoryTransport | None:
        return self._nodes.get(address)

    async def deliver(
        self,
        sender: str,
        address: str,
        name: str,
        body: bytes,
        expected: str | None = None,
        sender_address: str = "",
    ) -> tuple[str, bytes]:
        """Carry one request and its answer; raises as a real network would (a node that is
        not ``expected`` is refused before it sees the request, as a handshake would).

        Returns:
            The peer id of the node that answered, and its packed answer.
        """
        self.num_calls += 1
        await self._leg()
        if self.latency.drop_probability and self._rng.random() < self.latency.drop_probability:
            await asyncio.Future()  # lost: only the caller's timeout ends this wait
        target = self._nodes.get(address)
        if target is None:
            raise TransportError(f"{name} to {address} failed: connection refused")
        if expected is not None and target.peer_id != expected:
            raise WrongPeerError(address, expected, target.peer_id)
        answer = await target.serve(sender, name, body, sender_address)
        await self._leg()
        return target.peer_id, answer


class MemoryTransport:
    """:class:`dht.net.transport.Transport` over a :class:`MemoryNetwork`.

    Args:
        network: the network this node joins on :meth:`start`.
        peer_id: this node's peer id (requests carry it as their sender).
        client_mode: join without an address: call others, answer nothing.
        request_timeout_s: default bound on one call, in seconds.
        limits: bounds on what this node accepts.
    """

    address_schemes = ("mem",)  # what addresses from the network may name (see dht.net.schema)

    def __init__(
        self,
        network: MemoryNetwork,
        peer_id: str,
        *,
        client_mode: bool = False,
        request_timeout_s: float = 10.0,
        limits: MessageLimits | None = None,
    ):
        self.network = network
        self.peer_id = peer_id
        self.client_mode = client_mode
        self.request_timeout_s = request_timeout_s
        self.limits = limits or MessageLimits()
        self.counters = ByteCounters()
        self.killed = False
        self._rpc_handlers: dict[str, RpcHandler] = {}
        self._address: str | None = None
        self._started = False
        self._closed = False

    @property
    def address(self) -> str | None:
        return self._address

    def add_rpc_handler(self, name: str, handler: RpcHandler) -> None:
        if self._started:
            raise RuntimeError("add handlers before start()")
        self._rpc_handlers[name] = handler

    def add_stream_handler(self, name: str, handler: StreamHandler) -> None:
        raise NotImplementedError("MemoryTransport does not simulate streams")

    def open_stream(
        self, address: str, name: str, header: Any, *, timeout_s=None, expected_peer=None
    ):
        raise NotImplementedError("MemoryTransport does not simulate streams")

    async def start(self) -> None:
        self._started = True
        if not self.client_mode:
            self._address = self.network.register(self)

    async def close(self) -> None:
        """Leave the network; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._address is not None:
            self.network.unregister(self._address)

    async def __aenter__(self) -> MemoryTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def peer_at(self, address: str) -> str | None:
        """The peer id of the node at ``address`` (the in-memory network knows it)."""
        target = self.network.node_at(address)
        return target.peer_id if target is not None else None

    async def call(
        self,
        address: str,
        name: str,
        payload: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ) -> Any:
        if not self._started or self._closed or self.killed:
            raise TransportError("transport is not started, closed or killed")
        body = pack(payload)
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                remote, answer = await self.network.deliver(
                    self.peer_id, address, name, body, expected_peer, self._address or ""
                )
        except TimeoutError:
            raise RequestTimeoutError(
                f"{name} to {address} took longer than {timeout_s} s"
            ) from None
        self.counters.add_sent(remote, len(body))
        self.counters.add_recv(remote, len(answer))
        self.counters.add_rpc(name, len(body), len(answer))
        return unpack(answer, self.limits)

    async def serve(self, sender: str, name: str, body: bytes, sender_address: str = "") -> bytes:
        """Run the handler for one request that reached this node; the answer, packed.

        ``sender_address`` stands for the connection's source: the caller's own address.
        """
        handler = self._rpc_handlers.get(name)
        if handler is None:
            raise RemoteError(404, f"no RPC named {name!r}")
        try:
            payload = unpack(body, self.limits)
            result = await handler(RequestContext(sender, sender_address), payload)
        except DHTError as e:
            status = next((s for kind, s in _STATUS_OF if isinstance(e, kind)), 500)
            raise RemoteError(status, str(e)) from None
        except Exception as e:  # a handler bug answers 500, as the HTTP server would
            logger.exception("handler %s failed", name)
            raise RemoteError(500, f"internal error: {type(e).__name__}") from None
        self.counters.add_recv(sender, len(body))
        answer = pack(result)
        self.counters.add_sent(sender, len(answer))
        self.counters.add_rpc(name, len(answer), len(body))
        return answer
