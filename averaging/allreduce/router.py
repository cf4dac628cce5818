"""Routes incoming part streams to the round (group) they belong to, and to the reducer of the
slice of this peer's part that each stream carries.

A stream may arrive a little before this peer has heard that its group formed (the leader's
answer to it can lag the answer to the sender): it is held up to ``group_wait_s`` for the group
to be registered. How long a held stream waited is a sample of the connect wait
(:mod:`averaging.allreduce.deadlines`); a group registered after its early streams were refused
means that wait ran out (only a member knows a group's id: a stranger's streams for made-up
groups teach nothing). Streams for a group that is over, or that never shows up, are refused, and
a member whose stream header is malformed is dropped from the round at once. (The sender of a
stream is its transport-level peer id: authenticated when the swarm has a key.)
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping

from averaging.allreduce.deadlines import CONNECT, Deadlines
from averaging.allreduce.protocol import PartHeader
from averaging.allreduce.reducer import PartReducer
from averaging.errors import ProtocolViolation
from dht.errors import BadMessageError

_NUM_FINISHED_REMEMBERED = 64
_NUM_REFUSED_REMEMBERED = 64  # groups whose early streams were refused, the newest


class PartRouter:
    """The stream handler of the averaging protocol on one transport.

    Args:
        transport: the network; the handler is added here (before the transport starts).
        stream_name: the handler's name.
        group_wait_s: how long a stream waits for its group to be registered, in seconds (the
            averager sets it again each round: :attr:`group_wait_s`).
        deadlines: where the waits of held streams are learned (None: nowhere).
    """

    def __init__(
        self,
        transport,
        stream_name: str,
        *,
        group_wait_s: float,
        deadlines: Deadlines | None = None,
    ):
        self.group_wait_s = group_wait_s
        self._deadlines = deadlines
        self._refused: deque[str] = deque(maxlen=_NUM_REFUSED_REMEMBERED)
        self._reducers: dict[str, Mapping[int, PartReducer]] = {}
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._finished: deque[str] = deque(maxlen=_NUM_FINISHED_REMEMBERED)
        transport.add_stream_handler(stream_name, self._handle)

    def register(self, group_id: str, reducers: Mapping[int, PartReducer]) -> None:
        """Route streams of ``group_id`` to the reducer of the slice they name (no reducers:
        this peer reduces no part)."""
        self._reducers[group_id] = dict(reducers)
        if group_id in self._refused and self._deadlines is not None:
            self._deadlines.ran_out(CONNECT)  # a member's stream was early by more than the wait
        for waiter in self._waiters.pop(group_id, []):
            if not waiter.done():
                waiter.set_result(None)

    def _drop_sender_of(self, stream, reason: str) -> None:
        """A member whose header is malformed is out of the round: do not wait for it."""
        raw = stream.header
        group_id = raw.get("group") if isinstance(raw, dict) else None
        reducers = self._reducers.get(group_id, {}) if isinstance(group_id, str) else {}
        for reducer in reducers.values():
            reducer.drop(stream.sender, reason)

    def unregister(self, group_id: str) -> None:
        self._reducers.pop(group_id, None)
        self._finished.append(group_id)

    async def _reducer_for(self, group_id: str, stream: int) -> PartReducer | None:
        """The reducer of ``stream`` of this peer's part in ``group_id`` (None: no such stream).

        Raises:
            BadMessageError: the group is over or unknown, or this peer reduces nothing in it.
        """
        if group_id not in self._reducers and group_id not in self._finished:
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.setdefault(group_id, []).append(waiter)
            held_at = loop.time()
            try:
                async with asyncio.timeout(self.group_wait_s):
                    await waiter
                if self._deadlines is not None:
                    self._deadlines.observe_connection(loop.time() - held_at)
            except TimeoutError:
                if group_id not in self._refused:
                    self._refused.append(group_id)
            finally:
                waiters = self._waiters.get(group_id, [])
                if waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[group_id]
        if group_id in self._finished and group_id not in self._reducers:
            raise BadMessageError("this group's round is over")
        if group_id not in self._reducers:
            raise BadMessageError("unknown group")
        reducers = self._reducers[group_id]
        if not reducers:
            raise BadMessageError("this peer reduces no part in this group")
        return reducers.get(stream)

    async def _handle(self, stream) -> None:
        try:
            header = PartHeader.from_wire(stream.header)
        except ProtocolViolation as e:
            self._drop_sender_of(stream, f"bad stream header: {e}")
            raise BadMessageError(str(e)) from None
        reducer = await self._reducer_for(header.group_id, header.stream)
        if reducer is None:
            reason = f"this peer's part has no stream {header.stream} in this group"
            self._drop_sender_of(stream, reason)
            raise BadMessageError(reason)
        try:
            await reducer.serve(stream, header)
        except ProtocolViolation as e:
            # out of one slice is out of the round: the same as with one stream per part
            self._drop_sender_of(stream, str(e))
            raise BadMessageError(str(e)) from None
