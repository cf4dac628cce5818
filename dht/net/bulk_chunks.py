"""Large stream payloads handed to the socket without the HTTP layer's copy.

aiohttp sends each body write as one chunk of HTTP/1.1's chunked transfer encoding by joining
the chunk's size line, the data and the closing CRLF into one new bytes object (on Python before
3.12.9 it never uses the transport's scatter write; and Python 3.11's transports join a
``writelines`` anyway), and the transport then copies the part the socket did not take at once
out of that joined object again. For a tensor's megabytes that is two copies of every byte sent.

:class:`BulkChunkWriter` writes the same three pieces as three writes to the same transport: the
bytes on the wire are those aiohttp would send, while the caller's buffer itself is offered to the
socket. Python's transports keep what the socket did not take at once: Python 3.11 copies it,
Python 3.12 and later keep a reference to the caller's buffer. So a write returns only once the
transport holds none of its bytes (they are in the kernel's socket buffer), and the caller may
change its buffer as soon as the write returns. Only aiohttp's own writer, chunked and
uncompressed, is wrapped; anything else keeps the plain path, and small pieces that are views go
to it as bytes (a copy of under :data:`BULK_MIN_BYTES`), for the same reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import aiohttp
from aiohttp.http_writer import StreamWriter
from aiohttp.payload import AsyncIterablePayload

BULK_MIN_BYTES = 64 * 1024  # smaller pieces: the join costs less than two more writes


class BulkChunkWriter:
    """Writes large pieces of a chunked HTTP body straight to the connection's transport.

    Args:
        writer: aiohttp's writer of the body (see :meth:`wrap`).
    """

    def __init__(self, writer: StreamWriter):
        self._writer = writer

    @classmethod
    def wrap(cls, writer: Any) -> BulkChunkWriter | None:
        """A bulk writer over ``writer``, or None where the plain path must be kept: not
        aiohttp's :class:`StreamWriter`, not chunked, compressed, or without a transport."""
        if not isinstance(writer, StreamWriter) or not writer.chunked:
            return None
        if getattr(writer, "_compress", None) is not None or writer.transport is None:
            return None
        return cls(writer)

    async def write(self, data: bytes | memoryview) -> None:
        """Send ``data`` as one chunk of the body; return once the transport holds none of it.

        Raises:
            aiohttp.ClientConnectionResetError: the connection is closing or closed (and
                ConnectionResetError if it breaks while the rest is sent; then, as when the
                wait is cancelled, the connection is aborted).
        """
        writer = self._writer
        transport = writer.transport
        if transport is None or transport.is_closing():
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        send_headers = getattr(writer, "send_headers", None)
        if send_headers is not None:
            send_headers()  # (aiohttp >= 3.10 may still hold the headers back to coalesce them)
        view = memoryview(data).cast("B")
        transport.write(b"%x\r\n" % len(view))
        transport.write(view)
        transport.write(b"\r\n")
        if transport.get_write_buffer_size():
            try:
                await self._flushed(transport)
            except BaseException:
                # Cut short (cancelled, or the connection broke): what the transport still
                # holds is the caller's memory, which it may change now, and half a chunk is of
                # no use to the other end; so nothing more goes out on this connection.
                transport.abort()
                raise

    async def _flushed(self, transport) -> None:
        """Wait until ``transport`` has handed every byte written to the socket: with both its
        limits at 0 it pauses aiohttp's protocol now, and resumes it once its buffer is empty."""
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0, low=0)
        try:
            await self._writer.drain()
        finally:
            if not transport.is_closing():
                transport.set_write_buffer_limits(high=high, low=low)


def plain_piece(piece: bytes | memoryview) -> bytes:
    """``piece`` as bytes, for the plain path (which may keep it past the write)."""
    return piece if isinstance(piece, bytes) else bytes(piece)


async def write_pieces(pieces: AsyncIterator[bytes | memoryview], writer: Any) -> None:
    """Write every piece of ``pieces`` as a chunk of the body ``writer`` sends: large ones
    through :class:`BulkChunkWriter` where it applies, the others through ``writer``."""
    bulk = BulkChunkWriter.wrap(writer)
    async for piece in pieces:
        if bulk is not None and len(piece) >= BULK_MIN_BYTES:
            await bulk.write(piece)
        else:
            await writer.write(plain_piece(piece))


class PiecesPayload(AsyncIterablePayload):
    """A request body of pieces from an async iterator, large ones written without a copy.

    Args:
        pieces: the body's pieces, each a bytes-like object of bytes (``memoryview.cast("B")``).
    """

    def __init__(self, pieces: AsyncIterable[bytes | memoryview], **kwargs: Any):
        kwargs.setdefault("content_type", "application/octet-stream")
        super().__init__(pieces, **kwargs)
        self._pieces = pieces.__aiter__()

    async def write(self, writer: Any) -> None:
        await write_pieces(self._pieces, writer)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        # (aiohttp calls this since 3.12; a chunked body has no length to respect)
        await write_pieces(self._pieces, writer)
