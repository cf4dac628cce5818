"""The transport interface every layer above ``dht`` talks to.

Two primitives, addressed by a node URL (``http://host:port``) and a handler name:

* ``call``: one msgpack request, one msgpack response (DHT RPCs, matchmaking).
* ``open_stream``: a msgpack header, then binary chunks both ways, full duplex (tensor parts).

:class:`dht.http.HttpTransport` implements it over aiohttp;
:class:`dht.tools.memory.MemoryTransport` implements it in memory for simulations of thousands of
nodes. Fault injection wraps a transport. Handlers raise :class:`dht.errors.BadMessageError`
(answered 400), :class:`dht.errors.AuthError` (401), :class:`dht.errors.ValidationError` (422) or
:class:`dht.errors.BusyError` (429) to refuse.

The sender a handler is given (``RequestContext.sender``, ``IncomingStream.sender``) is proven: the
transport checked that the caller holds that peer id's private key.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RequestContext:
    """Who sent a request.

    Attributes:
        sender: the sender's peer id, proven by the transport (a signed handshake).
        remote_host: the source IP address of the connection ("" when not known).
    """

    sender: str
    remote_host: str = ""


@dataclass
class PeerBytes:
    """Bytes exchanged with one remote peer (payload bytes of bodies and frames)."""

    sent: int = 0
    recv: int = 0


# A request and its response both at most this big time a round trip (little serialization).
SMALL_RPC_BYTES = 4096
# Round-trip samples kept (a bounded memory for a busy interval; older ones drop out).
MAX_RTT_SAMPLES = 4096


@dataclass
class ByteCounters:
    """Totals and per-peer byte counts, and round-trip times of small requests; the profiler
    and the metrics stream read these.

    The event loop writes them and other threads (the metrics stream, the training thread's
    averager) read them, so the RTT samples are read under a lock: iterating a deque that
    another thread appends to raises ``RuntimeError: deque mutated during iteration``.
    """

    sent: int = 0
    recv: int = 0
    per_peer: dict[str, PeerBytes] = field(default_factory=dict)
    # bytes of request/response bodies per RPC name (both sides), e.g. "dht.find": what the DHT
    # costs apart from matchmaking and tensor streams; names are the registered handlers' and
    # this side's own calls, so the map stays small
    per_rpc: dict[str, PeerBytes] = field(default_factory=dict)
    # (monotonic time, peer, seconds) of each small request this side made
    rtt_samples: collections.deque[tuple[float, str, float]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_RTT_SAMPLES)
    )
    _rtt_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_rtt(self, peer: str, rtt_s: float) -> None:
        """A small request to ``peer`` was answered ``rtt_s`` seconds after it was sent."""
        with self._rtt_lock:
            self.rtt_samples.append((time.monotonic(), peer, rtt_s))

    def median_rtt_s(self, since_s: float) -> float | None:
        """The median over peers of each peer's fastest small request since ``since_s``
        (monotonic seconds); None if there was none. The fastest, because some requests wait
        at the server (a matchmaking leader holds a join) and a round trip is their floor.
        Safe to call from any thread."""
        fastest: dict[str, float] = {}
        with self._rtt_lock:
            for at_s, peer, rtt_s in reversed(self.rtt_samples):
                if at_s < since_s:
                    break
                fastest[peer] = min(rtt_s, fastest.get(peer, rtt_s))
        return statistics.median(fastest.values()) if fastest else None

    def add_sent(self, peer: str, num_bytes: int) -> None:
        self.sent += num_bytes
        self.per_peer.setdefault(peer, PeerBytes()).sent += num_bytes

    def add_recv(self, peer: str, num_bytes: int) -> None:
        self.recv += num_bytes
        self.per_peer.setdefault(peer, PeerBytes()).recv += num_bytes

    def add_rpc(self, name: str, sent_bytes: int, recv_bytes: int) -> None:
        """One RPC named ``name`` sent ``sent_bytes`` and received ``recv_bytes`` (body bytes,
        counted as well by :meth:`add_sent` and :meth:`add_recv`)."""
        counted = self.per_rpc.setdefault(name, PeerBytes())
        counted.sent += sent_bytes
        counted.recv += recv_bytes


class IncomingStream(Protocol):
    """The server side of a stream, handed to a stream handler.

    Attributes:
        sender: the caller's peer id, proven by the transport.
        header: the stream's header (msgpack, as the caller sent it; its digest was proven).
        remote_host: the connection's source IP address ("" when not known).
    """

    sender: str
    header: Any
    remote_host: str

    async def recv(self) -> bytes | None:
        """The next chunk from the sender, or None once it finished sending."""

    async def recv_into(self, buffer: memoryview) -> int | None:
        """Read the next chunk into ``buffer``; its length, or None once the sender finished."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def reply(self, header: Any) -> None:
        """Start the reply with a msgpack header; call once, before :meth:`send`."""

    async def send(self, chunk: bytes | memoryview) -> None:
        """Send one binary chunk of the reply (waits while the receiver is behind)."""


class OutgoingStream(Protocol):
    """The client side of a stream."""

    async def send(self, chunk: bytes | memoryview) -> None:
        """Send one binary chunk (waits while the receiver is behind)."""

    async def finish_sending(self) -> None:
        """Signal that no more chunks follow."""

    async def reply_header(self) -> Any:
        """The remote's reply header; raises RemoteError if it refused the stream."""

    async def recv(self) -> bytes | None:
        """The next reply chunk, or None at the end of the reply."""

    async def recv_into(self, buffer: memoryview) -> int | None:
        """Read the next reply chunk into ``buffer``; its length, or None at the end."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...


RpcHandler = Callable[[RequestContext, Any], Awaitable[Any]]
StreamHandler = Callable[[IncomingStream], Awaitable[None]]


class Transport(Protocol):
    """What ``dht`` and ``averaging`` need from the network."""

    peer_id: str
    counters: ByteCounters

    @property
    def address(self) -> str | None:
        """This node's URL, or None in client mode (no server)."""

    def add_rpc_handler(self, name: str, handler: RpcHandler) -> None: ...

    def add_stream_handler(self, name: str, handler: StreamHandler) -> None: ...

    def peer_at(self, address: str) -> str | None:
        """The proven peer id of the node at ``address`` if this transport talked to it lately
        (the in-memory transport knows every node)."""

    async def call(
        self,
        address: str,
        name: str,
        payload: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ) -> Any:
        """Send ``payload`` to handler ``name`` at ``address`` and return its answer.

        The node that answers has proven its peer id; with ``expected_peer`` any other peer is
        refused before the request is sent (:class:`dht.errors.WrongPeerError`).

        Raises:
            WrongPeerError: ``expected_peer`` was given and another peer answers there.
            RequestTimeoutError: no answer within ``timeout_s`` (default: the configured
                ``request_timeout_s``).
            RemoteError: the remote refused (4xx) or failed (5xx).
            TransportError: the connection failed.
        """

    def open_stream(
        self,
        address: str,
        name: str,
        header: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ) -> AbstractAsyncContextManager[OutgoingStream]:
        """Open a full-duplex stream; ``timeout_s`` bounds each wait for the remote.

        As with :meth:`call`, ``expected_peer`` refuses any other peer before the header is sent.
        """
