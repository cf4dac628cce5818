"""Many HTTP requests over one WebSocket: the tunnel between a relay and a relayed peer.

Every WebSocket message is binary: ``[kind u8][stream id u32 LE][payload]``. The relay opens a
stream per forwarded request (odd ids, increasing):

* ``OPEN`` (relay to peer): msgpack ``{m: method, p: path, h: {header: value}}``
* ``HEAD`` (peer to relay): msgpack ``{s: status, h: {header: value}}``
* ``DATA`` (both ways): body bytes, at most :data:`MAX_DATA_BYTES` per message
* ``END`` (both ways): this direction's body is complete
* ``CREDIT`` (both ways): u32 LE, bytes the sender may send more on this stream
* ``RESET`` (both ways): msgpack ``{reason}``; the stream is over in both directions

Flow control is per stream and per direction: a sender starts with :data:`WINDOW_BYTES` of credit
and the receiver grants more as its consumer takes bytes, so one slow stream never blocks the
others (the reader loop only appends to a buffer that credit bounds) and memory stays bounded:
a peer that sends beyond its credit breaks the protocol and the tunnel is closed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from dht.errors import BadMessageError, RequestTimeoutError, TransportError
from dht.net.wire import MessageLimits, pack, unpack

logger = logging.getLogger(__name__)

OPEN, HEAD, DATA, END, CREDIT, RESET = 1, 2, 3, 4, 5, 6
_PREFIX = struct.Struct("<BI")
_CREDIT = struct.Struct("<I")
WINDOW_BYTES = 512 << 10
MAX_DATA_BYTES = 256 << 10
# the WebSocket's max_msg_size (aiohttp refuses a message of exactly that size: leave room)
MAX_MESSAGE_BYTES = MAX_DATA_BYTES + 1024
_CONTROL_LIMITS = MessageLimits(max_body_bytes=16 << 10, max_msgpack_depth=4, max_msgpack_len=4096)
_ENDED = object()  # in a stream's inbox: the other side's body is complete


class MuxStream:
    """One request (and its answer) inside a tunnel."""

    def __init__(self, mux: Mux, stream_id: int):
        self.id = stream_id
        self._mux = mux
        self._inbox: deque = deque()
        self._arrived = asyncio.Event()
        self._buffered_bytes = 0  # received and not yet read: at most WINDOW_BYTES
        self._unacked_bytes = 0  # read and not yet granted back as credit
        self._credit_bytes = WINDOW_BYTES  # what this side may still send
        self._credit_changed = asyncio.Event()
        self._error: TransportError | None = None
        self.ended = False  # this side sent END
        self._was_reset = False  # a RESET was sent or received
        self._got_end = False  # the other side's END was read
        self._end_arrived = False  # the other side's END is in the inbox (or was read)

    # ---- called by the reader loop (never blocks) -----------------------------------------------

    def _deliver(self, item: Any) -> None:
        if item is _ENDED:
            self._end_arrived = True
        elif isinstance(item, bytes):
            self._buffered_bytes += len(item)
            if self._buffered_bytes > WINDOW_BYTES:
                raise BadMessageError(f"stream {self.id}: data beyond the granted credit")
        self._inbox.append(item)
        self._arrived.set()

    def _grant(self, num_bytes: int) -> None:
        self._credit_bytes += num_bytes
        self._credit_changed.set()

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        self._arrived.set()
        self._credit_changed.set()

    # ---- the stream's owner -------------------------------------------------------------------

    async def _next(self) -> Any:
        while not self._inbox:
            if self._error is not None:
                raise self._error
            self._arrived.clear()
            try:
                async with asyncio.timeout(self._mux.idle_timeout_s):
                    await self._arrived.wait()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"relayed stream idle for {self._mux.idle_timeout_s} s"
                ) from None
        # A reset abandons what is still in the inbox, unless the other side's answer is all
        # there (its END arrived): then the reset only stops this side's sending (a relayed
        # peer that answered, say a 429, without reading the caller's body), and the answer is
        # read to its end, even if the reset arrived before this side read its HEAD.
        if isinstance(self._error, _ResetError) and not self._end_arrived:
            raise self._error
        return self._inbox.popleft()

    async def read_message(self) -> dict:
        """The OPEN or HEAD message that starts this direction."""
        item = await self._next()
        if not isinstance(item, dict):
            raise BadMessageError(f"stream {self.id}: expected a message first")
        return item

    async def read(self) -> bytes | None:
        """The next body bytes, or None once the other side's body is complete."""
        item = await self._next()
        if item is _ENDED:
            self._got_end = True
            return None
        if not isinstance(item, bytes):
            raise BadMessageError(f"stream {self.id}: a second message in one direction")
        self._buffered_bytes -= len(item)
        self._unacked_bytes += len(item)
        if self._unacked_bytes >= WINDOW_BYTES // 2:
            granted, self._unacked_bytes = self._unacked_bytes, 0
            await self._mux.send(CREDIT, self.id, _CREDIT.pack(granted))
        return item

    async def write_message(self, kind: int, message: dict) -> None:
        await self._mux.send(kind, self.id, pack(message))

    async def write(self, data: bytes | memoryview) -> None:
        """Send body bytes, waiting for credit (each wait bounded by the idle timeout)."""
        view = memoryview(data).cast("B")
        while view:
            while self._credit_bytes <= 0:
                if self._error is not None:
                    raise self._error
                self._credit_changed.clear()
                try:
                    async with asyncio.timeout(self._mux.idle_timeout_s):
                        await self._credit_changed.wait()
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"relayed stream: nothing taken for {self._mux.idle_timeout_s} s"
                    ) from None
            if self._error is not None:
                raise self._error
            num_bytes = min(len(view), self._credit_bytes, MAX_DATA_BYTES)
            self._credit_bytes -= num_bytes
            await self._mux.send(DATA, self.id, view[:num_bytes])
            view = view[num_bytes:]

    async def end(self) -> None:
        """This side's body is complete."""
        self.ended = True
        await self._mux.send(END, self.id, b"")

    async def close(self, reason: str) -> None:
        """Forget a stream complete both ways, or reset one that is not."""
        if self.ended and self._got_end:
            self._mux.forget(self)
        else:
            await self.reset(reason)

    async def reset(self, reason: str) -> None:
        """Abandon the stream in both directions (a no-op once the tunnel is gone); this
        side's waits on it fail at once."""
        self._mux.forget(self)
        self._fail(TransportError(f"relayed stream reset: {reason}"))
        if self._was_reset or self._mux.closed or (self.ended and self._got_end):
            return
        self._was_reset = True
        try:
            await self._mux.send(RESET, self.id, pack({"reason": reason[:200]}))
        except TransportError:
            pass  # the tunnel is gone: nothing is left to tell


class _ResetError(TransportError):
    """The other side reset the stream."""


class Mux:
    """Streams over one WebSocket; :meth:`run` reads until the WebSocket closes.

    Args:
        ws: the open WebSocket (either end).
        idle_timeout_s: bound on each wait for data or credit, in seconds.
        write_timeout_s: bound on each write to the WebSocket, in seconds; the tunnel is closed
            beyond it (the other end stopped reading).
        max_streams: the most streams open at once; more OPENs are reset.
        on_open: for the relayed end: called (in a task the mux owns) with each new stream.
    """

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse | Any,
        *,
        idle_timeout_s: float,
        write_timeout_s: float,
        max_streams: int,
        on_open: Callable[[MuxStream], Awaitable[None]] | None = None,
    ):
        self.ws = ws
        self.idle_timeout_s = idle_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_streams = max_streams
        self._on_open = on_open
        self._streams: dict[int, MuxStream] = {}
        self._next_id = 1
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.closed = False
        self.close_reason = ""

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def open(self) -> MuxStream:
        """A new stream (the relay's end); the caller sends its OPEN."""
        if self.closed:
            raise TransportError("relay tunnel is closed")
        stream = MuxStream(self, self._next_id)
        self._next_id += 2
        self._streams[stream.id] = stream
        return stream

    def forget(self, stream: MuxStream) -> None:
        self._streams.pop(stream.id, None)

    async def send(self, kind: int, stream_id: int, payload: bytes | memoryview) -> None:
        if self.closed:
            raise TransportError("relay tunnel is closed")
        message = _PREFIX.pack(kind, stream_id) + bytes(payload)
        try:
            async with self._send_lock, asyncio.timeout(self.write_timeout_s):
                await self.ws.send_bytes(message)
        except TimeoutError:
            await self.close(f"the other end read nothing for {self.write_timeout_s} s")
            raise RequestTimeoutError("relay tunnel stalled") from None
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as e:
            await self.close(f"write failed: {e}")
            raise TransportError(f"relay tunnel closed: {e}") from e

    async def run(self) -> None:
        """Read and dispatch messages until the WebSocket closes (then every stream fails)."""
        reason = "relay tunnel closed"
        try:
            async for message in self.ws:
                if message.type != aiohttp.WSMsgType.BINARY:
                    reason = f"relay tunnel got a {message.type.name} message: {message.data}"
                    break
                self._dispatch(message.data)
        except BadMessageError as e:
            reason = f"relay tunnel protocol error: {e}"
            logger.warning("%s; closing it", reason)
        finally:
            await self.close(reason)

    def _dispatch(self, data: bytes) -> None:
        if len(data) < _PREFIX.size:
            raise BadMessageError("message shorter than its prefix")
        kind, stream_id = _PREFIX.unpack_from(data)
        payload = data[_PREFIX.size :]
        if kind == OPEN:
            self._accept(stream_id, _control(payload))
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # reset here already: late messages of it are dropped
        if kind == HEAD:
            stream._deliver(_control(payload))
        elif kind == DATA:
            stream._deliver(payload)
        elif kind == END:
            stream._deliver(_ENDED)
        elif kind == CREDIT and len(payload) == _CREDIT.size:
            stream._grant(_CREDIT.unpack(payload)[0])
        elif kind == RESET:
            # The stream fails whatever the payload holds: a reason that does not parse must
            # not leave its owner waiting for the idle timeout.
            self.forget(stream)
            stream._was_reset = True
            reason = _reset_reason(payload)
            stream._fail(_ResetError(f"relayed stream reset by the other end: {reason}"[:300]))
        else:
            raise BadMessageError(f"unknown message kind {kind}")

    def _accept(self, stream_id: int, message: dict) -> None:
        if self._on_open is None or stream_id in self._streams or stream_id % 2 == 0:
            raise BadMessageError(f"unexpected OPEN of stream {stream_id}")
        stream = MuxStream(self, stream_id)
        self._streams[stream_id] = stream
        stream._deliver(message)
        if len(self._streams) > self.max_streams:
            self._spawn(stream.reset(f"more than {self.max_streams} relayed requests at once"))
            return
        self._spawn(self._on_open(stream))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("relayed request failed: %s", task.exception())

    async def close(self, reason: str = "relay tunnel closed") -> None:
        """Fail every stream, close the WebSocket, cancel the mux's tasks; safe twice."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        for stream in list(self._streams.values()):
            stream._fail(TransportError(reason))
        self._streams.clear()
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        for task in tasks:
            task.cancel()
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.ws.close()
        except (TimeoutError, ConnectionError, aiohttp.ClientError, RuntimeError):
            pass  # the other end is gone: there is no one to say goodbye to
        await asyncio.gather(*tasks, return_exceptions=True)


def _reset_reason(payload: bytes) -> str:
    try:
        reason = _control(payload).get("reason", "")
    except BadMessageError:
        return "(malformed reason)"
    return reason if isinstance(reason, str) else "(malformed reason)"


def _control(payload: bytes) -> dict:
    message = unpack(payload, _CONTROL_LIMITS)
    if not isinstance(message, dict):
        raise BadMessageError("a control message must be a map")
    return message
