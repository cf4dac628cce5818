"""Reading and writing the frames of a stream (format in :mod:`dht.net.wire`).

Both sides of a stream use these two classes over whatever moves the bytes: aiohttp's request and
response bodies in :mod:`dht.http`. Payloads are written as memoryview slices and read straight into
the caller's buffer where it offers one, so a tensor crosses with no avoidable copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from dht.errors import AuthError, BadMessageError, StreamAbortedError, TransportError
from dht.net.auth import FRAME_TAG_BYTES, FrameTagger
from dht.net.wire import (
    FRAME_BIN,
    FRAME_ERROR,
    FRAME_HEADER,
    FRAME_MSG,
    MessageLimits,
    pack,
    unpack,
)


class ByteSource(Protocol):
    """The part of aiohttp's StreamReader that frames need."""

    async def readexactly(self, n: int) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...


class FrameReader:
    """Reads frames from one direction of a stream, checking sizes, order and MAC tags."""

    def __init__(
        self,
        source: ByteSource,
        *,
        limits: MessageLimits,
        idle_timeout_s: float,
        tagger: FrameTagger | None = None,
        direction: bytes = b"up",
    ):
        self._source = source
        self._limits = limits
        self._idle_timeout_s = idle_timeout_s
        self._tagger = tagger
        self._direction = direction
        self._seq = 0
        self.num_bytes = 0
        self.finished = False

    async def _read_exactly(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                return await self._source.readexactly(n)
        except (asyncio.IncompleteReadError, TimeoutError):
            raise
        except Exception as e:  # the HTTP layer's payload errors: a broken connection
            raise TransportError(f"stream broken: {e}") from e

    async def _next_header(self) -> tuple[int, int, bytes] | None:
        if self.finished:
            return None
        try:
            raw = await self._read_exactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise BadMessageError("stream ended inside a frame header") from None
            self.finished = True
            return None
        kind, length = FRAME_HEADER.unpack(raw)
        limit = self._limits.max_chunk_bytes if kind == FRAME_BIN else self._limits.max_body_bytes
        if kind not in (FRAME_MSG, FRAME_BIN, FRAME_ERROR):
            raise BadMessageError(f"unknown frame kind {kind}")
        if length > limit:
            raise BadMessageError(f"frame of {length} bytes exceeds the limit of {limit}")
        return kind, length, raw

    async def _check_tag(self, raw_header: bytes, payload: bytes | memoryview) -> None:
        if self._tagger is not None:
            try:
                given = await self._read_exactly(FRAME_TAG_BYTES)
            except asyncio.IncompleteReadError:
                raise BadMessageError("stream ended inside a frame tag") from None
            expected = self._tagger.tag(self._direction, self._seq, raw_header, payload)
            FrameTagger.check(expected, given)
        self._seq += 1
        self.num_bytes += len(payload)

    async def read_message(self) -> Any:
        """The next frame as a msgpack message (the header of a direction)."""
        return unpack(await self.read_message_raw(), self._limits)

    async def read_message_raw(
        self,
        charge: Callable[[int], None] | None = None,
        *,
        stall_timeout_s: float | None = None,
    ) -> bytes:
        """The payload of the next frame, which must be a msgpack message frame.

        Args:
            charge: called with the size of each block of the payload as it arrives (never
                with the announced length; it may raise to refuse the frame).
            stall_timeout_s: bound on each wait for the next block (default: the idle timeout).
        """
        header = await self._next_header()
        if header is None:
            raise BadMessageError("stream ended before its header")
        kind, length, raw = header
        if kind == FRAME_BIN:
            raise BadMessageError("expected a header frame, got a binary frame")
        if charge is None:
            payload = await self._read_payload(length)
        else:
            payload = await self._read_charged(length, charge, stall_timeout_s)
        await self._check_tag(raw, payload)
        if kind == FRAME_ERROR:
            raise StreamAbortedError(_reason(_unpack_error(payload, self._limits)))
        return payload

    async def _read_charged(
        self, length: int, charge: Callable[[int], None], stall_timeout_s: float | None
    ) -> bytes:
        blocks, filled = [], 0
        while filled < length:
            try:
                async with asyncio.timeout(stall_timeout_s or self._idle_timeout_s):
                    block = await self._source.read(length - filled)
            except TimeoutError:
                raise
            except Exception as e:  # the HTTP layer's payload errors: a broken connection
                raise TransportError(f"stream broken: {e}") from e
            if not block:
                raise BadMessageError("stream ended inside a frame")
            charge(len(block))
            blocks.append(block)
            filled += len(block)
        return b"".join(blocks)

    async def read_chunk(self) -> bytes | None:
        """The next binary chunk, or None at the end of the stream."""
        header = await self._next_header()
        if header is None:
            return None
        kind, length, raw = header
        payload = await self._read_payload(length)
        await self._check_tag(raw, payload)
        return self._binary(kind, payload)

    async def read_chunk_into(self, buffer: memoryview) -> int | None:
        """Read the next binary chunk into ``buffer``; its length, or None at the end."""
        header = await self._next_header()
        if header is None:
            return None
        kind, length, raw = header
        if kind != FRAME_BIN:
            payload = await self._read_payload(length)
            await self._check_tag(raw, payload)
            self._binary(kind, payload)  # raises
        if length > len(buffer):
            raise BadMessageError(f"chunk of {length} bytes overflows a {len(buffer)}-byte buffer")
        filled = 0
        while filled < length:
            try:
                async with asyncio.timeout(self._idle_timeout_s):
                    block = await self._source.read(length - filled)
            except TimeoutError:
                raise
            except Exception as e:
                raise TransportError(f"stream broken: {e}") from e
            if not block:
                raise BadMessageError("stream ended inside a chunk")
            buffer[filled : filled + len(block)] = block
            filled += len(block)
        await self._check_tag(raw, buffer[:length])
        return length

    async def _read_payload(self, length: int) -> bytes:
        try:
            return await self._read_exactly(length) if length else b""
        except asyncio.IncompleteReadError:
            raise BadMessageError("stream ended inside a frame") from None

    def _binary(self, kind: int, payload: bytes) -> bytes:
        if kind == FRAME_BIN:
            return payload
        if kind == FRAME_ERROR:
            raise StreamAbortedError(_reason(_unpack_error(payload, self._limits)))
        raise BadMessageError("unexpected header frame in the middle of a stream")


def _unpack_error(payload: bytes, limits: MessageLimits) -> Any:
    try:
        return unpack(payload, limits)
    except BadMessageError:
        return None  # an error frame that does not parse is still an error: its reason unknown


def _reason(message: Any) -> str:
    if isinstance(message, dict) and isinstance(message.get("reason"), str):
        return message["reason"]
    return "stream aborted by the remote"


class FrameWriter:
    """Writes frames of one direction through ``write`` (an async callable taking bytes-like)."""

    def __init__(
        self,
        write: Callable[[bytes | memoryview], Awaitable[None]],
        *,
        tagger: FrameTagger | None = None,
        direction: bytes = b"up",
    ):
        self._write = write
        self._tagger = tagger
        self._direction = direction
        self._seq = 0
        self.num_bytes = 0

    async def _frame(self, kind: int, payload: bytes | memoryview) -> None:
        header = FRAME_HEADER.pack(kind, len(payload))
        await self._write(header)
        if len(payload):
            await self._write(payload)
        if self._tagger is not None:
            await self._write(self._tagger.tag(self._direction, self._seq, header, payload))
        self._seq += 1
        self.num_bytes += len(payload)

    async def write_message(self, message: Any) -> None:
        await self._frame(FRAME_MSG, pack(message))

    async def write_message_bytes(self, packed: bytes) -> None:
        """Write an already packed message (its digest was signed in the request headers)."""
        await self._frame(FRAME_MSG, packed)

    async def write_chunk(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk).cast("B") if not isinstance(chunk, bytes) else chunk
        await self._frame(FRAME_BIN, view)

    async def write_error(self, reason: str) -> None:
        await self._frame(FRAME_ERROR, pack({"reason": reason}))


__all__ = ["AuthError", "FrameReader", "FrameWriter"]
