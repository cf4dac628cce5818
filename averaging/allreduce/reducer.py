"""The reducer's side of one part: accumulate every sender's chunks, stream the average back.

Chunk ``i`` of the part is averaged once every sender still in the round has delivered its chunk
``i`` (or was dropped): the weighted sum is accumulated in float32 as chunks arrive, then divided
by the weights of those who delivered, so a sender dropped half-way counts in the chunks it
delivered and not in the others. The reducer's own contribution is added in-process when a chunk's
slot opens. Only ``max_chunks_in_flight`` chunks are accumulated at once; a sender that is further
ahead waits (and TCP holds it back). Every averaged chunk is encoded once and the same bytes go to
every sender; the reducer keeps the decoded bytes itself, so the whole group ends with identical
values. Each sender's stream is read and answered by :mod:`averaging.allreduce.inbound`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import numpy as np

from averaging.allreduce.accumulator import make_window
from averaging.allreduce.deadlines import CONNECT, SENDER, Deadlines
from averaging.allreduce.inbound import InboundSender, InboundStreams
from averaging.allreduce.protocol import REPLY_LATE, REPLY_OK, PartHeader
from averaging.bounds import value_limit
from averaging.config import AveragerConfig
from averaging.errors import ProtocolViolation, describe_failure
from averaging.matchmaking.partition import Part
from averaging.rules.compression import Codec
from averaging.rules.robust import Aggregation
from averaging.work import Worker

logger = logging.getLogger(__name__)


class PartReducer:
    """Averages one part of the vector over the group.

    Args:
        part: the slice this peer reduces.
        values: this peer's values of the part (a view into its flattened vector); they are
            its own contribution, and are replaced by the average chunk by chunk.
        own_weight: this peer's weight (0: it contributes nothing).
        senders: every other member's peer id and weight.
        header: the header a sender must announce (its weight aside).
        codec: the group's wire format.
        config: timeouts and the in-flight window.
        worker: runs and times the numpy work.
        aggregation: how contributions combine (:mod:`averaging.rules.robust`).
        deadlines: where the waits for senders are measured (None: nowhere that matters).
    """

    def __init__(
        self,
        *,
        part: Part,
        values: np.ndarray,
        own_weight: float,
        senders: Mapping[str, float],
        header: PartHeader,
        codec: Codec,
        config: AveragerConfig,
        worker: Worker,
        aggregation: Aggregation = Aggregation.MEAN,
        deadlines: Deadlines | None = None,
    ):
        self.part = part
        self._values = values
        self._own_weight = own_weight
        self._header = header
        self._codec = codec
        self._timeout_s = config.sender_timeout_s
        self._deadlines = deadlines or Deadlines(config)
        # a sender's stream, from the round's start (see averaging.allreduce.deadlines)
        self._connect_s = max(self._timeout_s, self._deadlines.connect_s)
        self._worker = worker
        robust = aggregation is not Aggregation.MEAN
        # a robust window holds a row per contributor: fewer chunks in flight
        in_flight = min(config.max_chunks_in_flight, 2) if robust else config.max_chunks_in_flight
        self._window = max(1, min(in_flight, part.num_chunks))
        num_contributors = 1 + len(senders)
        # each weighted contribution within limit: their sum (or differences) cannot overflow
        limit = value_limit(2 * num_contributors if robust else num_contributors)
        self._limit = limit
        self._acc = make_window(
            aggregation,
            window=self._window,
            chunk_numel=part.chunk_numel,
            senders=list(senders),
            limit=limit,
        )
        loop = asyncio.get_running_loop()
        now = self._started_at = loop.time()
        self._senders = {
            peer: InboundSender(
                peer, w, part.num_chunks if w > 0 else 0, row=row, last_progress=now
            )
            for row, (peer, w) in enumerate(senders.items(), start=1)
        }
        self._weight_sum = [0.0] * part.num_chunks
        self._num_contributors = [0] * part.num_chunks
        self._opened_at = [0.0] * part.num_chunks
        self._opened = [loop.create_future() for _ in range(part.num_chunks)]
        self._averaged = [loop.create_future() for _ in range(part.num_chunks)]
        self._changed = asyncio.Event()
        self._closed = False
        self._over = asyncio.Event()  # closed, and the streams still open had their time
        self._streams = InboundStreams(
            part=part,
            codec=codec,
            worker=worker,
            timeout_s=self._timeout_s,
            limit=limit,
            weighted_decode=self._acc.weighted_decode,
            opened=self._opened,
            averaged=self._averaged,
            deliver=self._deliver,
            deadlines=self._deadlines,
        )
        self.averaged_numel = 0  # values whose average includes another peer's contribution

    @property
    def dropped(self) -> dict[str, str]:
        """Senders dropped so far and why."""
        return {s.peer_id: s.dropped_reason for s in self._senders.values() if s.dropped}

    # ---- the reduction -----------------------------------------------------------------------

    async def run(self) -> None:
        """Average every chunk, then wait until every sender has its replies (or is dropped)."""
        for chunk in range(self._window):
            self._open(chunk)
        for chunk in range(self.part.num_chunks):
            await self._wait_for_chunk(chunk)
            await self._average(chunk)
            if chunk + self._window < self.part.num_chunks:
                self._open(chunk + self._window)
        await self._wait_until_served()

    def _open(self, chunk: int) -> None:
        lo, hi = self.part.chunk_bounds(chunk)
        if self._acc.open(chunk, self._values[lo:hi], self._own_weight):
            self._weight_sum[chunk] = self._own_weight
            self._num_contributors[chunk] = 1
        elif self._own_weight > 0:
            logger.warning("part %d: own values too large to weigh; not counted", self.part.index)
        self._opened_at[chunk] = asyncio.get_running_loop().time()
        self._opened[chunk].set_result(None)

    def _deadline(self, sender: InboundSender, chunk: int) -> float:
        if not sender.connected:
            return self._started_at + self._connect_s
        return self._waiting_since(sender, chunk) + self._timeout_s

    def _waiting_since(self, sender: InboundSender, chunk: int) -> float:
        return max(sender.last_progress, self._opened_at[chunk])

    def _drop_late(self, sender: InboundSender) -> None:
        if sender.connected:
            self._deadlines.ran_out(SENDER)
            self.drop(sender.peer_id, f"no chunk within sender_timeout_s={self._timeout_s}")
        else:
            self._deadlines.ran_out(CONNECT)
            sender.late = True  # should its stream still come, it gets the averages only
            self.drop(sender.peer_id, f"no connection within connect_s={self._connect_s:.3g}")

    async def _wait_for_chunk(self, chunk: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            missing = [
                s
                for s in self._senders.values()
                if not s.dropped and s.num_chunks > chunk and s.delivered <= chunk
            ]
            if not missing:
                return
            now = loop.time()
            deadlines = {s: self._deadline(s, chunk) for s in missing}
            overdue = [s for s, deadline in deadlines.items() if deadline <= now]
            for sender in overdue:
                self._drop_late(sender)
            if overdue:
                continue
            self._changed.clear()
            try:
                async with asyncio.timeout_at(min(deadlines.values())):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _average(self, chunk: int) -> None:
        lo, hi = self.part.chunk_bounds(chunk)
        own = self._values[lo:hi]
        total = self._weight_sum[chunk]
        average = None
        if total > 0:
            cost = 0 if self._acc.weighted_decode else self._num_contributors[chunk] * (hi - lo)
            average = await self._worker.run(
                "reduce", cost, self._acc.average, chunk, hi - lo, total
            )
            if average is None:
                logger.warning("part %d chunk %d: average not finite", self.part.index, chunk)
        if average is None:
            self._averaged[chunk].set_result((None, 0))  # nobody's values: everyone keeps theirs
            return
        if self._codec.is_identity:
            await self._worker.run("reduce", 0, np.copyto, own, average)
            payload = own
        else:
            payload = await self._worker.run("encode", hi - lo, self._encode, average)
            await self._worker.run("decode", hi - lo, self._codec.decode_into, payload, own)
        num_contributors = self._num_contributors[chunk]
        self._averaged[chunk].set_result((payload, num_contributors))
        if num_contributors > (self._own_weight > 0):  # someone else's values are in it
            self.averaged_numel += hi - lo

    def _encode(self, average: np.ndarray) -> memoryview:
        return memoryview(self._codec.encode(average)).cast("B")

    async def _wait_until_served(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [
                s for s in self._senders.values() if not (s.dropped or s.done_event.is_set())
            ]
            waiting = [s for s in pending if not s.connected]
            if waiting and loop.time() >= self._started_at + self._connect_s:
                for sender in waiting:
                    self._drop_late(sender)
                continue
            if not pending:
                return
            self._changed.clear()
            deadline = self._started_at + self._connect_s if waiting else None
            try:
                async with asyncio.timeout_at(deadline):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def _progress(self, sender: InboundSender, waiting_since: float | None = None) -> None:
        """``sender`` connected, or delivered a chunk ``waiting_since`` was its deadline's
        start: measure that wait (a connection's is not a link's: it waits on matchmaking)."""
        now = asyncio.get_running_loop().time()
        if waiting_since is not None:
            self._deadlines.observe_sender_wait(now - waiting_since)
        sender.last_progress = now
        self._changed.set()

    async def _deliver(self, sender: InboundSender, chunk: int, values: np.ndarray) -> bool:
        """Count ``sender``'s checked ``values`` of ``chunk``; False once it was dropped or the
        round is over (its stream reads no further)."""
        if sender.dropped or self._closed:
            return False
        await self._worker.run("reduce", 0, self._acc.add, chunk, sender.row, values, sender.weight)
        self._weight_sum[chunk] += sender.weight
        self._num_contributors[chunk] += 1
        sender.delivered = chunk + 1
        self._progress(sender, self._waiting_since(sender, chunk))
        return True

    # ---- senders -----------------------------------------------------------------------------

    def drop(self, peer_id: str, reason: str) -> None:
        """Stop waiting for ``peer_id``; its stream is ended with ``reason``."""
        sender = self._senders.get(peer_id)
        if sender is None or sender.dropped or sender.done_event.is_set():
            return
        sender.dropped_reason = reason
        sender.drop_event.set()
        self._changed.set()
        logger.info("part %d: dropped sender %s: %s", self.part.index, peer_id[:8], reason)

    def _admit(self, peer_id: str, header: PartHeader) -> InboundSender:
        sender = self._senders.get(peer_id)
        if sender is None:
            raise ProtocolViolation("sender is not a member of this group")
        expected = self._header
        if (header.part, header.stream, header.numel, header.chunk_numel, header.compression) != (
            expected.part,
            expected.stream,
            expected.numel,
            expected.chunk_numel,
            expected.compression,
        ):
            raise ProtocolViolation(
                f"header does not match the group's part {expected.part} stream "
                f"{expected.stream} (got stream {header.stream}): "
                f"numel {header.numel} vs {expected.numel}, chunk {header.chunk_numel} vs "
                f"{expected.chunk_numel}, compression {header.compression.value} vs "
                f"{expected.compression.value}"
            )
        if header.weight != sender.weight:
            raise ProtocolViolation(f"weight {header.weight} differs from the group's record")
        if sender.connected:
            raise ProtocolViolation("a second stream for the same part")
        if self._closed or (sender.dropped and not sender.late):
            raise ProtocolViolation(f"sender was dropped: {sender.dropped_reason or 'round over'}")
        return sender

    async def serve(self, stream, header: PartHeader) -> None:
        """Handle one sender's stream until its replies are sent or it is dropped.

        Raises:
            ProtocolViolation: the stream is refused or the sender was dropped (the reason is
                sent back to it).
        """
        try:
            sender = self._admit(stream.sender, header)
        except ProtocolViolation as e:
            # A member whose stream is refused is out of the round: do not wait for it.
            if stream.sender in self._senders and not self._closed:
                self.drop(stream.sender, f"stream refused: {e}")
            raise
        sender.connected = True
        self._deadlines.observe_connection(asyncio.get_running_loop().time() - self._started_at)
        if sender.late:
            await self._serve_late(sender, stream)
            return
        self._progress(sender)
        try:
            await stream.reply(REPLY_OK)
            await self._streams.serve(sender, stream)
        except Exception as e:
            if isinstance(e, TimeoutError):  # a read or write of ours ran out
                self._deadlines.ran_out(SENDER)
            self.drop(sender.peer_id, describe_failure(e, self._timeout_s))
            raise ProtocolViolation(sender.dropped_reason or str(e)) from e
        finally:
            sender.done_event.set()
            self._changed.set()

    async def _serve_late(self, sender: InboundSender, stream) -> None:
        """Every average to a sender dropped for connecting late, so that its replica ends
        equal to the group's; it stays dropped (its values count nowhere)."""
        logger.info(
            "part %d: late sender %s gets the averages", self.part.index, sender.peer_id[:8]
        )
        tasks = {asyncio.create_task(self._over.wait())}
        try:
            await stream.reply(REPLY_LATE)
            writing = asyncio.create_task(self._streams.write_averages(stream))
            tasks.add(writing)
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if not writing.done():  # an average that will never come: the round ran out
                raise ProtocolViolation("late sender: the round is over")
            if writing.exception() is not None:
                raise writing.exception()
        except ProtocolViolation:
            raise
        except Exception as e:
            raise ProtocolViolation(f"late sender: {describe_failure(e, self._timeout_s)}") from e
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            sender.done_event.set()
            self._changed.set()

    async def close(self) -> None:
        """End every stream still open (the round is over) and wait for their handlers."""
        self._closed = True
        if not all(future.done() for future in self._averaged):
            self._over.set()  # averages that will not come: a late sender's writes end now
        for sender in self._senders.values():
            self.drop(sender.peer_id, "the round is over")
        waits = [
            asyncio.create_task(s.done_event.wait())
            for s in self._senders.values()
            if s.connected and not s.done_event.is_set()
        ]
        if waits:
            try:
                await asyncio.wait(waits, timeout=self._timeout_s)
            finally:
                for task in waits:
                    task.cancel()
                await asyncio.wait(waits)
        self._over.set()  # a late sender still writing waits on averages that will not come
