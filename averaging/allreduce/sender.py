"""The sender's side of one remote part: stream its chunks up, take the averaged chunks back.

Sending and receiving run at once on the one full-duplex stream. Averaged chunks are received
into a scratch buffer and checked before they replace this peer's values, so a stream that breaks
half-way leaves every value either averaged or untouched, never torn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from averaging.allreduce.accumulator import checked
from averaging.allreduce.deadlines import REDUCER, Deadlines
from averaging.allreduce.protocol import (
    CHUNK_HEADER,
    REPLY_LATE,
    REPLY_OK,
    PartHeader,
    pack_chunk_header,
)
from averaging.allreduce.protocol import unpack_chunk_header as parse_chunk_header
from averaging.bounds import FLOAT32_MAX
from averaging.config import AveragerConfig
from averaging.errors import (
    AveragingError,
    BadChunkError,
    ProtocolViolation,
    describe_failure,
    translate,
)
from averaging.matchmaking.group import GroupMember
from averaging.matchmaking.partition import Part
from averaging.rules.compression import Codec
from averaging.work import Worker
from dht.errors import DHTError


@dataclass
class PartExchange:
    """How the exchange of one remote part went.

    Attributes:
        reducer: the peer id of the part's reducer.
        numel: values in the part.
        averaged_numel: values replaced by an average that includes another peer's values.
        error: why the exchange stopped early (None if every chunk came back, or if it was
            still going when the round's time ran out: then ``done`` is False).
        done: the exchange ended, in success or failure.
        late: the reducer had dropped this peer for connecting late: the averages came back,
            without this peer's values.
    """

    reducer: str
    numel: int
    averaged_numel: int = 0
    error: str | None = None
    done: bool = False
    late: bool = False


class PartSender:
    """Exchanges one part with its reducer.

    Args:
        transport: the network (``open_stream``).
        stream_name: the averaging stream handler's name.
        reducer: the member that reduces this part.
        header: what to announce.
        part: the slice.
        values: this peer's values of the part; replaced chunk by chunk by the average.
        codec: the group's wire format.
        config: timeouts.
        worker: runs and times the numpy work.
        deadlines: where the waits for the reducer are measured (None: nowhere that matters).
    """

    def __init__(
        self,
        *,
        transport,
        stream_name: str,
        reducer: GroupMember,
        header: PartHeader,
        part: Part,
        values: np.ndarray,
        codec: Codec,
        config: AveragerConfig,
        worker: Worker,
        deadlines: Deadlines | None = None,
    ):
        self._transport = transport
        self._stream_name = stream_name
        self._reducer = reducer
        self._header = header
        self._part = part
        self._values = values
        self._codec = codec
        self._timeout_s = config.reducer_timeout_s
        self._worker = worker
        self._deadlines = deadlines or Deadlines(config)
        self.result = PartExchange(reducer.peer_id, part.numel)

    async def run(self) -> PartExchange:
        """Exchange the part; failures end up in ``result.error``, never raised."""
        try:
            await self._exchange()
        except (DHTError, AveragingError, TimeoutError) as e:
            error = translate(e) if isinstance(e, DHTError) else e
            if isinstance(e, TimeoutError):
                self._deadlines.ran_out(REDUCER)
            self.result.error = describe_failure(error, self._timeout_s)
        self.result.done = True
        return self.result

    async def _exchange(self) -> None:
        async with self._transport.open_stream(
            self._reducer.address,
            self._stream_name,
            self._header.to_wire(),
            timeout_s=self._timeout_s,
        ) as stream:
            sending = asyncio.create_task(self._send(stream))
            try:
                await self._receive(stream)
            finally:
                if not sending.done():
                    sending.cancel()
                await asyncio.wait({sending})
                send_error = None if sending.cancelled() else sending.exception()
            if send_error is not None and not self.result.late:
                raise send_error  # a late sender's chunks are not read: its stream may end first

    async def _send(self, stream) -> None:
        if self._header.weight > 0:
            prefetched: asyncio.Task | None = None
            try:
                for chunk in range(self._part.num_chunks):
                    if prefetched is None:
                        prefetched = asyncio.create_task(self._encode(chunk))
                    payload = await prefetched
                    prefetched = None
                    if chunk + 1 < self._part.num_chunks and not self._codec.is_identity:
                        prefetched = asyncio.create_task(self._encode(chunk + 1))
                    await stream.send(pack_chunk_header(chunk, len(payload)))
                    await stream.send(payload)
                    self._worker.stats.bytes_sent += CHUNK_HEADER.size + len(payload)
            finally:
                if prefetched is not None:
                    prefetched.cancel()
                    await asyncio.wait({prefetched})
                    if not prefetched.cancelled():
                        prefetched.exception()  # retrieved: the error that matters is raised
        await stream.finish_sending()

    async def _encode(self, chunk: int) -> memoryview:
        lo, hi = self._part.chunk_bounds(chunk)
        values = self._values[lo:hi]
        if self._codec.is_identity:
            return memoryview(values).cast("B")
        encoded = await self._worker.run("encode", hi - lo, self._codec.encode, values)
        return memoryview(encoded).cast("B")

    async def _recv_into(self, stream, buffer: memoryview) -> int:
        num_bytes = await stream.recv_into(buffer)
        if num_bytes is None:
            raise ProtocolViolation("the reducer's reply ended before the last chunk")
        self._worker.stats.bytes_received += num_bytes
        return num_bytes

    async def _receive(self, stream) -> None:
        loop = asyncio.get_running_loop()
        since = loop.time()
        reply = await stream.reply_header()
        if reply not in (REPLY_OK, REPLY_LATE):
            raise ProtocolViolation("unexpected reply header from the reducer")
        self.result.late = reply == REPLY_LATE
        codec, part = self._codec, self._part
        header = memoryview(bytearray(CHUNK_HEADER.size))
        buffer = np.empty(codec.encoded_nbytes(part.chunk_numel), dtype=np.uint8)
        decoded = np.empty(part.chunk_numel, dtype=np.float32)
        for chunk in range(part.num_chunks):
            nbytes, num_contributors = parse_chunk_header(
                header[: await self._recv_into(stream, header)], chunk
            )
            since = self._observe(since, loop.time())
            if nbytes == 0:
                continue  # nobody's contribution arrived at the reducer: keep our values
            lo, hi = part.chunk_bounds(chunk)
            if nbytes != codec.encoded_nbytes(hi - lo):
                raise BadChunkError(f"averaged chunk {chunk}: {nbytes} bytes for {hi - lo} values")
            view = memoryview(buffer)[:nbytes]
            if await self._recv_into(stream, view) != nbytes:
                raise BadChunkError(f"averaged chunk {chunk} is shorter than its header says")
            since = self._observe(since, loop.time())
            cost = 0 if codec.is_identity else hi - lo  # raw float32 is cheap to check inline
            await self._worker.run(
                "decode", cost, self._accept, view, decoded[: hi - lo], self._values[lo:hi]
            )
            if num_contributors > (self._header.weight > 0):  # not only our own values
                self.result.averaged_numel += hi - lo

    def _observe(self, since: float, now: float) -> float:
        """The reducer's next frame came ``now - since`` after the last: measure it."""
        self._deadlines.observe_reducer_wait(now - since)
        return now

    def _accept(self, payload: memoryview, scratch: np.ndarray, out: np.ndarray) -> None:
        """Replace our values by the average, only once it is known to be well-formed."""
        if self._codec.checks_finite:  # it refuses a bad payload before writing anything
            self._codec.decode_into(payload, out)
            return
        if self._codec.is_identity:
            values = np.frombuffer(payload, dtype="<f4", count=out.size)
        else:
            self._codec.decode_into(payload, scratch)
            values = scratch
        np.copyto(out, checked(values, FLOAT32_MAX))
