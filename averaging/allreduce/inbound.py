"""The reducer's end of its senders' streams: each sender's chunks in, every average back.

A sender's chunk is read only once the reducer (:mod:`averaging.allreduce.reducer`) has opened
its slot, decoded times the sender's weight (for the mean) and checked after weighting, so that
no sum of contributions overflows, before the reducer counts it. Meanwhile every averaged chunk
goes back on the same full-duplex stream as soon as it is ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from averaging.allreduce.accumulator import checked
from averaging.allreduce.deadlines import Deadlines
from averaging.allreduce.protocol import CHUNK_HEADER, pack_chunk_header
from averaging.allreduce.protocol import unpack_chunk_header as parse_chunk_header
from averaging.errors import BadChunkError, ProtocolViolation
from averaging.matchmaking.partition import Part
from averaging.rules.compression import Codec
from averaging.work import Worker


@dataclass(eq=False)
class InboundSender:
    """One sender as its reducer sees it: what it owes, what it delivered, whether it is out."""

    peer_id: str
    weight: float
    num_chunks: int  # chunks it owes (0 for weight 0)
    row: int  # its row in a robust window (this peer's is 0)
    last_progress: float
    connected: bool = False
    late: bool = False  # dropped for not connecting in time: a stream of its gets averages only
    delivered: int = 0
    dropped_reason: str | None = None
    drop_event: asyncio.Event = field(default_factory=asyncio.Event)
    done_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def dropped(self) -> bool:
        return self.dropped_reason is not None


# (sender, chunk, its checked values) -> whether to read on: False once the sender was dropped
# or the round is over
Deliver = Callable[[InboundSender, int, np.ndarray], Awaitable[bool]]


class InboundStreams:
    """Reads the chunks of the senders of one part and writes the averages back to them.

    Args:
        part: the slice the reducer reduces.
        codec: the group's wire format.
        worker: runs and times the numpy work.
        timeout_s: bound on each read and each write, in seconds (``sender_timeout_s``).
        limit: the largest magnitude of one weighted value.
        weighted_decode: whether a sender's values are decoded times its weight.
        opened: per chunk, done once the reducer takes contributions to it.
        averaged: per chunk, its encoded average (None: nobody's values) and how many
            contributed to it.
        deliver: counts one chunk of a sender (see :data:`Deliver`).
        deadlines: where the link's waits are measured.
    """

    def __init__(
        self,
        *,
        part: Part,
        codec: Codec,
        worker: Worker,
        timeout_s: float,
        limit: float,
        weighted_decode: bool,
        opened: Sequence[asyncio.Future[None]],
        averaged: Sequence[asyncio.Future[tuple[object, int]]],
        deliver: Deliver,
        deadlines: Deadlines,
    ):
        self.part = part
        self._codec = codec
        self._worker = worker
        self._timeout_s = timeout_s
        self._limit = limit
        self._weighted_decode = weighted_decode
        self._opened = opened
        self._averaged = averaged
        self._deliver = deliver
        self._deadlines = deadlines

    async def serve(self, sender: InboundSender, stream) -> None:
        """Read ``sender``'s chunks and write every average back until both are done.

        Raises:
            ProtocolViolation: ``sender`` was dropped meanwhile (with its reason).
        """
        tasks = {asyncio.create_task(self.write_averages(stream))}
        if sender.num_chunks:
            tasks.add(asyncio.create_task(self._read(sender, stream)))
        dropped = asyncio.create_task(sender.drop_event.wait())
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks | {dropped}, return_when=asyncio.FIRST_COMPLETED)
                tasks -= done
                errors = [t.exception() for t in done - {dropped} if not t.cancelled()]
                for error in errors:
                    if error is not None:
                        raise error  # what the reader or writer raised
                if dropped in done:
                    raise ProtocolViolation(sender.dropped_reason)
        finally:
            for task in (*tasks, dropped):
                task.cancel()
            await asyncio.wait({*tasks, dropped})

    async def _recv_into(self, stream, buffer: memoryview) -> int:
        async with asyncio.timeout(self._timeout_s):
            num_bytes = await stream.recv_into(buffer)
        if num_bytes is None:
            raise BadChunkError("stream ended before the last chunk")
        self._worker.stats.bytes_received += num_bytes
        return num_bytes

    async def _read(self, sender: InboundSender, stream) -> None:
        codec, part = self._codec, self.part
        header = memoryview(bytearray(CHUNK_HEADER.size))
        max_nbytes = codec.encoded_nbytes(part.chunk_numel)
        buffer = np.empty(max_nbytes, dtype=np.uint8)
        decoded = None if codec.is_identity else np.empty(part.chunk_numel, dtype=np.float32)
        for chunk in range(sender.num_chunks):
            await asyncio.shield(
                self._opened[chunk]
            )  # shared: a cancelled reader must not cancel it
            nbytes, _ = parse_chunk_header(header[: await self._recv_into(stream, header)], chunk)
            size = part.chunk_size(chunk)
            if nbytes != codec.encoded_nbytes(size):
                raise BadChunkError(f"chunk {chunk} of {nbytes} bytes, expected {size} values")
            view = memoryview(buffer)[:nbytes]
            if await self._recv_into(stream, view) != nbytes:
                raise BadChunkError(f"chunk {chunk} is shorter than its header says")
            target = None if decoded is None else decoded[:size]
            values = await self._worker.run(
                "decode", self._cost(size), self._decode_weighted, view, target, size, sender.weight
            )
            if not await self._deliver(sender, chunk, values):
                return

    def _cost(self, numel: int) -> int:
        """The size that decides whether work leaves the loop: raw float32 is cheap to check."""
        return 0 if self._codec.is_identity else numel

    def _decode_weighted(self, payload, target, size: int, weight: float) -> np.ndarray:
        """The sender's values (times its weight, for the mean), checked after weighting: every
        one finite and within the limit, so that no sum of contributions overflows."""
        factor = weight if self._weighted_decode else 1.0
        with np.errstate(over="ignore", invalid="ignore"):  # what overflows is refused below
            if target is None:  # raw float32: weigh the received bytes in place
                values = np.frombuffer(payload, dtype="<f4", count=size)
                if factor != 1.0:
                    values *= np.float32(factor)
            else:
                self._codec.decode_into(payload, target, factor)
                values = target
        return checked(values, self._limit)

    async def write_averages(self, stream) -> None:
        """Write every averaged chunk to ``stream`` as it becomes ready (to a ``late`` sender
        too, whose chunks are not read: it stops sending once it has every average)."""
        for chunk in range(self.part.num_chunks):
            payload, num_contributors = await asyncio.shield(self._averaged[chunk])
            nbytes = 0 if payload is None else len(memoryview(payload).cast("B"))
            start = asyncio.get_running_loop().time()
            async with asyncio.timeout(self._timeout_s):
                await stream.send(pack_chunk_header(chunk, nbytes, num_contributors))
                if nbytes:
                    await stream.send(payload)
            # the sender's link, the other way
            self._deadlines.observe_sender_wait(asyncio.get_running_loop().time() - start)
            self._worker.stats.bytes_sent += CHUNK_HEADER.size + nbytes
