"""The two ends of a full-duplex stream over one HTTP/1.1 request (chunked both ways)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from dht.auth import SwarmAuth
from dht.errors import RemoteError, RequestTimeoutError, TransportError
from dht.frames import FrameReader, FrameWriter
from dht.transport import ByteCounters
from dht.wire import MessageLimits

_END = None  # sentinel in the send queue: the request body is complete
_SEND_QUEUE_PIECES = 6  # a frame is up to 3 pieces (header, payload, tag): ~2 frames in flight


class ServerStream:
    """The handler's end: read the sender's chunks, reply with a header and chunks."""

    def __init__(
        self,
        request: web.Request,
        *,
        sender: str,
        header: Any,
        reader: FrameReader,
        auth: SwarmAuth | None,
        nonce: str,
        counters: ByteCounters,
        own_peer_id: str,
    ):
        self.sender = sender
        self.header = header
        self._request = request
        self._reader = reader
        self._auth = auth
        self._nonce = nonce
        self._counters = counters
        self._own_peer_id = own_peer_id
        self._response: web.StreamResponse | None = None
        self._writer: FrameWriter | None = None

    @property
    def reply_started(self) -> bool:
        return self._response is not None

    async def recv(self) -> bytes | None:
        chunk = await self._reader.read_chunk()
        if chunk is not None:
            self._counters.add_recv(self.sender, len(chunk))
        return chunk

    async def recv_into(self, buffer: memoryview) -> int | None:
        num_bytes = await self._reader.read_chunk_into(buffer)
        if num_bytes:
            self._counters.add_recv(self.sender, num_bytes)
        return num_bytes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.recv()) is not None:
            yield chunk

    async def reply(self, header: Any) -> None:
        if self._response is not None:
            raise RuntimeError("reply() was already called")
        response = web.StreamResponse(
            headers={"x-vp-peer": self._own_peer_id, "content-type": "application/octet-stream"}
        )
        self._response = response
        await response.prepare(self._request)
        self._writer = FrameWriter(
            self._write, auth=self._auth, nonce=self._nonce, direction=b"down"
        )
        await self._writer.write_message(header)

    async def _write(self, data: bytes | memoryview) -> None:
        try:
            await self._response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionResetError) as e:
            raise TransportError(f"receiver of the stream went away: {e}") from e

    async def send(self, chunk: bytes | memoryview) -> None:
        if self._writer is None:
            raise RuntimeError("call reply() before send()")
        await self._writer.write_chunk(chunk)
        self._counters.add_sent(self.sender, len(memoryview(chunk).cast("B")))

    async def abort(self, reason: str) -> None:
        """End the reply early with an error frame (the reply has started)."""
        try:
            await self._writer.write_error(reason)
        except TransportError:
            pass  # the other end is gone; nobody is left to tell

    async def finish(self) -> web.StreamResponse:
        if self._response is None:
            await self.reply(None)
        try:
            await self._response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the client left after it had what it wanted
        return self._response


class ClientStream:
    """The caller's end; use as ``async with transport.open_stream(...) as stream``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        headers: dict[str, str],
        header_bytes: bytes,
        limits: MessageLimits,
        auth: SwarmAuth | None,
        counters: ByteCounters,
        idle_timeout_s: float,
    ):
        self._session = session
        self._url = url
        self._headers = headers
        self._header_bytes = header_bytes
        self._limits = limits
        self._auth = auth
        self._counters = counters
        self._idle_timeout_s = idle_timeout_s
        self._nonce = headers.get("x-vp-nonce", "")
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=_SEND_QUEUE_PIECES)
        self._writer = FrameWriter(self._queue.put, auth=auth, nonce=self._nonce, direction=b"up")
        self._response_task: asyncio.Task | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._reader: FrameReader | None = None
        self._reply_header: Any = None
        self._done_sending = False
        self._reply_lock = asyncio.Lock()
        self._remote = url
        self._unflushed_sent_bytes = 0

    async def __aenter__(self) -> ClientStream:
        await self._writer.write_message_bytes(self._header_bytes)
        self._response_task = asyncio.create_task(self._post())
        return self

    async def _post(self) -> aiohttp.ClientResponse:
        return await self._session.post(self._url, data=self._body(), headers=self._headers)

    async def _body(self) -> AsyncIterator[bytes | memoryview]:
        while (piece := await self._queue.get()) is not _END:
            yield piece

    async def send(self, chunk: bytes | memoryview) -> None:
        if self._done_sending:
            raise RuntimeError("send() after finish_sending()")
        if self._response_task.done() and self._reader is None:
            await self.reply_header()  # surfaces a refusal instead of filling a dead queue
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                await self._writer.write_chunk(chunk)
        except TimeoutError:
            raise RequestTimeoutError(f"{self._url} stopped reading the stream") from None
        self._unflushed_sent_bytes += len(memoryview(chunk).cast("B"))
        self._flush_counters()

    async def finish_sending(self) -> None:
        if not self._done_sending:
            self._done_sending = True
            await self._queue.put(_END)

    async def reply_header(self) -> Any:
        async with self._reply_lock:  # the sending and the receiving task may both ask
            if self._reader is None:
                await self._start_reply()
        return self._reply_header

    async def _start_reply(self) -> None:
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                self._response = await asyncio.shield(self._response_task)
        except TimeoutError:
            raise RequestTimeoutError(f"no reply from {self._url} in time") from None
        except (aiohttp.ClientError, OSError) as e:
            raise TransportError(f"stream to {self._url} failed: {e}") from e
        if self._response.status != 200:
            raise RemoteError(
                self._response.status, self._response.headers.get("x-vp-error") or "refused"
            )
        self._remote = self._response.headers.get("x-vp-peer", self._url)
        self._reader = FrameReader(
            self._response.content,
            limits=self._limits,
            auth=self._auth,
            nonce=self._nonce,
            idle_timeout_s=self._idle_timeout_s,
            direction=b"down",
        )
        self._reply_header = await self._read(self._reader.read_message())
        self._flush_counters()

    async def _read(self, awaitable):
        try:
            return await awaitable
        except TimeoutError:
            raise RequestTimeoutError(f"{self._url} stalled mid-stream") from None

    async def recv(self) -> bytes | None:
        await self.reply_header()
        chunk = await self._read(self._reader.read_chunk())
        if chunk is not None:
            self._counters.add_recv(self._remote, len(chunk))
        return chunk

    async def recv_into(self, buffer: memoryview) -> int | None:
        await self.reply_header()
        num_bytes = await self._read(self._reader.read_chunk_into(buffer))
        if num_bytes:
            self._counters.add_recv(self._remote, num_bytes)
        return num_bytes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.recv()) is not None:
            yield chunk

    def _flush_counters(self) -> None:
        if self._unflushed_sent_bytes and self._reader is not None:
            self._counters.add_sent(self._remote, self._unflushed_sent_bytes)
            self._unflushed_sent_bytes = 0

    async def __aexit__(self, *exc_info: object) -> None:
        if self._unflushed_sent_bytes:
            self._counters.add_sent(self._remote, self._unflushed_sent_bytes)
            self._unflushed_sent_bytes = 0
        task = self._response_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        elif task is not None and not task.cancelled() and task.exception() is None:
            task.result().close()
