"""The two ends of a full-duplex stream over one HTTP/1.1 request (chunked both ways).

The request's headers prove the caller and cover the digest of the stream's header frame (see
:mod:`dht.net.server`); the reply's headers carry a MAC over the reply's header frame under the
same session key, so the caller knows who answered. With a swarm key every frame is tagged too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from dht.errors import AuthError, RemoteError, RequestTimeoutError, TransportError
from dht.net.auth import FrameTagger
from dht.net.bulk_chunks import BULK_MIN_BYTES, BulkChunkWriter, PiecesPayload, plain_piece
from dht.net.client import ClientSessions, check_response, needs_new_session, signed_headers
from dht.net.frames import FrameReader, FrameWriter
from dht.net.session import digest, response_mac
from dht.net.transport import ByteCounters
from dht.net.wire import MessageLimits, pack, unpack

_END = None  # sentinel in the send queue: the request body is complete
_SEND_QUEUE_PIECES = 6  # a frame is up to 3 pieces (header, payload, tag): ~2 frames in flight


class _WriteWatchdog:
    """Cuts the connection of a reply whose reader let one write wait ``timeout_s`` or more.

    One timer per stream, checking every ``timeout_s / 2`` (a stalled write is cut after 1 to
    1.5 times ``timeout_s``), instead of a timer per frame: writes are the data path.
    """

    def __init__(self, request: web.Request, timeout_s: float):
        self._request = request
        self._timeout_s = timeout_s
        self.waiting_since_s: float | None = None
        self.fired = False
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self._timeout_s / 2, self._check)

    def _check(self) -> None:
        since_s = self.waiting_since_s
        if since_s is not None and time.monotonic() - since_s >= self._timeout_s:
            self.fired = True
            self._handle = None
            transport = self._request.transport
            if transport is not None:
                transport.abort()  # the write waiting on it raises at once
            return
        self.start()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class ServerStream:
    """The handler's end: read the sender's chunks, reply with a header and chunks."""

    def __init__(
        self,
        request: web.Request,
        *,
        sender: str,
        header: Any,
        reader: FrameReader,
        key: bytes,
        nonce: str,
        tagger: FrameTagger | None,
        counters: ByteCounters,
        own_peer_id: str,
        write_timeout_s: float,
        remote_host: str = "",
    ):
        self.sender = sender
        self.remote_host = remote_host
        self.header = header
        self._request = request
        self._reader = reader
        self._key = key
        self._nonce = nonce
        self._tagger = tagger
        self._counters = counters
        self._own_peer_id = own_peer_id
        self._write_timeout_s = write_timeout_s
        self._response: web.StreamResponse | None = None
        self._writer: FrameWriter | None = None
        self._bulk: BulkChunkWriter | None = None
        self._watchdog = _WriteWatchdog(request, write_timeout_s)

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
        packed = pack(header)
        response = web.StreamResponse(
            headers={
                "x-vp-peer": self._own_peer_id,
                "x-vp-mac": response_mac(self._key, self._nonce, 200, digest(packed)),
                "content-type": "application/octet-stream",
            }
        )
        self._response = response
        self._writer = FrameWriter(self._write, tagger=self._tagger, direction=b"down")
        self._watchdog.start()
        self._bulk = BulkChunkWriter.wrap(await self._guarded(response.prepare(self._request)))
        await self._writer.write_message_bytes(packed)

    async def _write(self, data: bytes | memoryview) -> None:
        if self._bulk is not None and len(data) >= BULK_MIN_BYTES:
            await self._guarded(self._bulk.write(data))  # a tensor's bytes: not copied first
        else:
            await self._guarded(self._response.write(plain_piece(data)))

    async def _guarded(self, writing) -> Any:
        # A receiver that stops reading blocks the writes once the socket buffers are full;
        # the watchdog then cuts the connection (stream_write_timeout_s).
        self._watchdog.waiting_since_s = time.monotonic()
        try:
            return await writing
        except (ConnectionError, aiohttp.ClientConnectionResetError) as e:
            if self._watchdog.fired:
                raise RequestTimeoutError(
                    f"receiver of the stream read nothing for {self._write_timeout_s} s"
                ) from None
            raise TransportError(f"receiver of the stream went away: {e}") from e
        finally:
            self._watchdog.waiting_since_s = None

    async def send(self, chunk: bytes | memoryview) -> None:
        """Send ``chunk`` as one binary frame; ``chunk`` may be changed once this returns."""
        if self._writer is None:
            raise RuntimeError("call reply() before send()")
        await self._writer.write_chunk(chunk)
        self._counters.add_sent(self.sender, len(memoryview(chunk).cast("B")))

    async def abort(self, reason: str) -> None:
        """End the reply early with an error frame (the reply has started)."""
        try:
            await self._writer.write_error(reason)
        except TransportError:
            pass  # the other end is gone or stuck; nobody is left to tell

    async def finish(self) -> web.StreamResponse:
        if self._response is None:
            await self.reply(None)
        try:
            await self._guarded(self._response.write_eof())
        except TransportError:
            pass  # the client left (or stopped reading) after it had what it wanted
        return self._response

    def close(self) -> None:
        """Stop the write watchdog (the stream is over, however it ended); safe twice."""
        self._watchdog.stop()


class ClientStream:
    """The caller's end; use as ``async with transport.open_stream(...) as stream``."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        address: str,
        path: str,
        *,
        header_bytes: bytes,
        sessions: ClientSessions,
        own_peer_id: str,
        expected_peer: str | None,
        tag_frames: bool,
        limits: MessageLimits,
        counters: ByteCounters,
        idle_timeout_s: float,
        handshake_timeout_s: float,
    ):
        self._http = http
        self._address = address
        self._path = path
        self._url = address + path
        self._header_bytes = header_bytes
        self._sessions = sessions
        self._own_peer_id = own_peer_id
        self._expected_peer = expected_peer
        self._tag_frames = tag_frames
        self._limits = limits
        self._counters = counters
        self._idle_timeout_s = idle_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._session = None
        self._nonce = ""
        self._tagger: FrameTagger | None = None
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=_SEND_QUEUE_PIECES)
        self._writer: FrameWriter | None = None
        self._response_task: asyncio.Task | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._reader: FrameReader | None = None
        self._reply_header: Any = None
        self._done_sending = False
        self._reply_lock = asyncio.Lock()
        self._remote = address
        self._unflushed_sent_bytes = 0

    async def __aenter__(self) -> ClientStream:
        self._session = await self._sessions.get(
            self._http,
            self._address,
            timeout_s=self._handshake_timeout_s,
            expected=self._expected_peer,
        )
        self._remote = self._session.peer_id
        headers = signed_headers(
            self._session, self._own_peer_id, "POST", self._path, digest(self._header_bytes)
        )
        headers["content-type"] = "application/octet-stream"
        self._nonce = headers["x-vp-nonce"]
        if self._tag_frames:
            self._tagger = FrameTagger(self._session.key, self._nonce)
        self._writer = FrameWriter(self._queue.put, tagger=self._tagger, direction=b"up")
        await self._writer.write_message_bytes(self._header_bytes)
        self._response_task = asyncio.create_task(self._post(headers))
        return self

    async def _post(self, headers: dict[str, str]) -> aiohttp.ClientResponse:
        body = PiecesPayload(self._body())  # large pieces reach the socket uncopied
        return await self._http.post(self._url, data=body, headers=headers)

    async def _body(self) -> AsyncIterator[bytes | memoryview]:
        while (piece := await self._queue.get()) is not _END:
            yield piece

    async def send(self, chunk: bytes | memoryview) -> None:
        """Queue ``chunk`` as one binary frame. A large chunk is read from the caller's memory
        when its turn to be written comes: keep it unchanged until the reply to it arrived."""
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
        response = self._response
        if response.status != 200:
            if needs_new_session(response):
                self._sessions.forget(self._address, self._session)
            raise RemoteError(response.status, response.headers.get("x-vp-error") or "refused")
        self._reader = FrameReader(
            response.content,
            limits=self._limits,
            tagger=self._tagger,
            idle_timeout_s=self._idle_timeout_s,
            direction=b"down",
        )
        packed = await self._read(self._reader.read_message_raw())
        try:
            check_response(self._session, self._nonce, 200, packed, response.headers)
        except AuthError as e:
            raise TransportError(f"stream to {self._url}: {e}") from e
        self._reply_header = unpack(packed, self._limits)
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
