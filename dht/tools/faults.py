"""Fault injection by wrapping a transport: delays, unreachable peers, streams cut short.

Tests and experiments wrap a node's real transport in :class:`FaultyTransport`; the code under test
runs unchanged over real sockets and meets the faults where a real network would put them.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from dht.errors import TransportError
from dht.net.transport import ByteCounters, OutgoingStream, RpcHandler, StreamHandler, Transport


@dataclass(kw_only=True)
class Faults:
    """What to inject (mutable: a test may change it while nodes run).

    Attributes:
        delay_s: added before every call and every stream send and receive, in seconds.
        unreachable: addresses whose calls and streams fail as if the host were down.
        cut_streams_after_bytes: outgoing streams fail once they have received this many bytes.
        cut_streams_to: only streams to these addresses are cut (None: every stream).
    """

    delay_s: float = 0.0
    unreachable: set[str] = field(default_factory=set)
    cut_streams_after_bytes: int | None = None
    cut_streams_to: set[str] | None = None


class FaultyTransport:
    """A :class:`dht.net.transport.Transport` passing everything to ``inner``, with ``faults``."""

    def __init__(self, inner: Transport, faults: Faults):
        self.inner = inner
        self.faults = faults

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    @property
    def counters(self) -> ByteCounters:
        return self.inner.counters

    @property
    def address(self) -> str | None:
        return self.inner.address

    def add_rpc_handler(self, name: str, handler: RpcHandler) -> None:
        self.inner.add_rpc_handler(name, handler)

    def add_stream_handler(self, name: str, handler: StreamHandler) -> None:
        self.inner.add_stream_handler(name, handler)

    async def _before(self, address: str) -> None:
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        if address in self.faults.unreachable:
            raise TransportError(f"{address} is unreachable (injected)")

    def peer_at(self, address: str) -> str | None:
        return self.inner.peer_at(address)

    async def call(
        self,
        address: str,
        name: str,
        payload: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ) -> Any:
        await self._before(address)
        return await self.inner.call(
            address, name, payload, timeout_s=timeout_s, expected_peer=expected_peer
        )

    @asynccontextmanager
    async def open_stream(
        self,
        address: str,
        name: str,
        header: Any,
        *,
        timeout_s: float | None = None,
        expected_peer: str | None = None,
    ):
        await self._before(address)
        inner = self.inner.open_stream(
            address, name, header, timeout_s=timeout_s, expected_peer=expected_peer
        )
        async with inner as stream:
            cut = self.faults.cut_streams_to is None or address in self.faults.cut_streams_to
            yield _FaultyStream(stream, self.faults, cut=cut)


class _FaultyStream:
    def __init__(self, inner: OutgoingStream, faults: Faults, *, cut: bool):
        self._inner = inner
        self._faults = faults
        self._cut = cut
        self._received_bytes = 0

    async def _delay(self) -> None:
        if self._faults.delay_s:
            await asyncio.sleep(self._faults.delay_s)

    def _count(self, num_bytes: int | None) -> None:
        limit = self._faults.cut_streams_after_bytes if self._cut else None
        self._received_bytes += num_bytes or 0
        if limit is not None and self._received_bytes > limit:
            raise TransportError(f"stream cut after {limit} bytes (injected)")

    async def send(self, chunk) -> None:
        await self._delay()
        await self._inner.send(chunk)

    async def finish_sending(self) -> None:
        await self._inner.finish_sending()

    async def reply_header(self) -> Any:
        return await self._inner.reply_header()

    async def recv(self) -> bytes | None:
        await self._delay()
        chunk = await self._inner.recv()
        self._count(len(chunk) if chunk is not None else None)
        return chunk

    async def recv_into(self, buffer: memoryview) -> int | None:
        await self._delay()
        num_bytes = await self._inner.recv_into(buffer)
        self._count(num_bytes)
        return num_bytes

    async def __aiter__(self):
        while (chunk := await self.recv()) is not None:
            yield chunk
