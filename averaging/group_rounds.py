"""GroupRounds: a step's values, from the tensors to a formed group's mean and back.

A step gathers its tensors into one flat vector (checking that they are finite) before it looks
for a group. Once it has one, the vector is all-reduced over the group in place, with the waits
of this round (:mod:`averaging.allreduce.deadlines`); a row goes on to the second level
(:mod:`averaging.levels`), and a peer that found no row may join the top round alone. What the
levels leave in the vector is then scattered back into the tensors. Which group a step joins,
and what the averager remembers of a round, stays with
:class:`averaging.averager.DecentralizedAverager`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping

from averaging.allreduce.butterfly import run_allreduce
from averaging.allreduce.deadlines import Deadlines
from averaging.allreduce.router import PartRouter
from averaging.allreduce.streams import StreamChooser
from averaging.config import AveragerConfig
from averaging.errors import ProtocolViolation
from averaging.levels import SecondLevel, TopRound
from averaging.matchmaking.group import GroupInfo
from averaging.result import RoundResult
from averaging.rounds import result_of
from averaging.rules.compression import Compression, get_codec
from averaging.tensors import FlatTensors

# the averager's name: a filter or level set on its logger still governs the gather's warning
logger = logging.getLogger("averaging.averager")


class GroupRounds:
    """Moves one averager's values through its rounds: gather, all-reduce, second level, scatter.

    Args:
        tensors: the averager's tensors, as one flat vector.
        transport: the network (the part streams' handler is added to it).
        stream_name: the part streams' name, one per averager prefix.
        peer_id: this peer.
        config: the averager's settings.
        deadlines: the averager's waits, adapted to the RTTs measured.
        streams: chooses the number of streams and learns from each round's throughput.
    """

    def __init__(
        self,
        tensors: FlatTensors,
        *,
        transport,
        stream_name: str,
        peer_id: str,
        config: AveragerConfig,
        deadlines: Deadlines,
        streams: StreamChooser,
    ):
        self._tensors = tensors
        self._transport = transport
        self._stream_name = stream_name
        self._peer_id = peer_id
        self._config = config
        self._deadlines = deadlines
        self._streams = streams
        self._router = PartRouter(
            transport,
            stream_name,
            group_wait_s=config.group_wait_s,
            deadlines=deadlines,
        )
        self._waits: Mapping[str, float] = {}  # the step in progress's (Deadlines.snapshot)

    async def gather(
        self, weight: float, compression: Compression, phase_s: dict[str, float]
    ) -> float:
        """Copy the tensors in; the weight to use (0 if the local values are not finite)."""
        start = asyncio.get_running_loop().time()
        finite = await asyncio.to_thread(self._gather_and_check, compression)
        phase_s["gather"] = asyncio.get_running_loop().time() - start
        if not finite and weight > 0:
            logger.warning("local tensors contain NaN or Inf: taking part with weight 0")
            return 0.0
        return weight

    def _gather_and_check(self, compression: Compression) -> bool:
        get_codec(compression).prepare()
        self._tensors.gather()
        return self._tensors.all_finite()

    async def average(
        self,
        group: GroupInfo,
        timeout_s: float,
        waits: Mapping[str, float],
        *,
        second: SecondLevel | None,
        top: TopRound | None = None,
    ) -> RoundResult:
        """Average with ``group`` and, when ``second`` is given (the group is a row), at the
        second level; the flat vector is left averaged, not yet scattered (:meth:`end`)."""
        self._waits = waits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delegate = second is not None and group.delegate == self._peer_id
        if delegate:
            # members may ask as soon as their row is averaged, and wait up to our deadline
            second.spreads.open(group, until=deadline)
        try:
            result = await self.allreduce(group, timeout_s)
            if second is not None:
                top = top or TopRound("", None, 0.0)
                result = await second.run(
                    group,
                    result,
                    top_key=top.key,
                    plan=top.plan,
                    deadline=deadline,
                    rows_end=top.rows_end,
                )
            else:
                result = dataclasses.replace(result, levels={"row": result.status})
        finally:
            if delegate:
                second.spreads.close(group.group_id)
        return result

    async def solo(
        self, second: SecondLevel, weight: float, top: TopRound, top_rows: int, deadline: float
    ) -> RoundResult:
        """No row: join the top round as a row of one (:meth:`SecondLevel.solo`)."""
        self._waits = self._deadlines.snapshot()
        return await second.solo(
            weight,
            top_key=top.key,
            plan=top.plan,
            top_rows=top_rows,
            deadline=deadline,
            rows_end=top.rows_end,
        )

    async def end(
        self, result: RoundResult, phase_s: dict[str, float], waits: Mapping[str, float]
    ) -> RoundResult:
        """Scatter what the levels left in the flat vector; ``result`` with the step's phases
        (``phase_s``, updated in place) and waits."""
        loop = asyncio.get_running_loop()
        phase_s.update({p: s for p, s in result.phase_s.items() if p != "matchmaking"})
        phase_s["matchmaking"] += result.phase_s.get("top_matchmaking", 0.0)
        if result.allreduce_s or result.status != "failed":
            start = loop.time()
            await asyncio.to_thread(self._tensors.scatter)
            phase_s["scatter"] = loop.time() - start
        return dataclasses.replace(result, phase_s=dict(phase_s), deadlines_s=dict(waits))

    async def allreduce(self, group: GroupInfo, timeout_s: float) -> RoundResult:
        """One all-reduce of the flat vector over ``group``, in place (no scatter)."""
        waits = self._waits
        loop = asyncio.get_running_loop()
        config = dataclasses.replace(  # this round's waits (see averaging.allreduce.deadlines)
            self._config,
            allreduce_timeout_s=min(self._config.allreduce_timeout_s, timeout_s),
            sender_timeout_s=waits["sender_s"],
            reducer_timeout_s=waits["reducer_s"],
            group_wait_s=waits["group_wait_s"],
        )
        self._router.group_wait_s = waits["group_wait_s"]
        start = loop.time()
        try:
            outcome = await run_allreduce(
                transport=self._transport,
                router=self._router,
                stream_name=self._stream_name,
                group=group,
                own_peer_id=self._peer_id,
                flat=self._tensors.flat,
                config=config,
                deadlines=self._deadlines,
            )
        except ProtocolViolation as e:  # a group no member can use: nothing was averaged
            return RoundResult("failed", str(e), group_id=group.group_id)
        finally:
            self._deadlines.end_round()
        phase_s = {"allreduce": loop.time() - start, **outcome.stats.cpu_s}
        result = result_of(group, outcome, phase_s)
        if result.status == "ok" and group.top_rows == 0:
            moved_bytes = result.bytes_sent + result.bytes_received
            self._streams.observe(group.num_streams, moved_bytes, result.allreduce_s)
        return result
