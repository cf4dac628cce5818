"""One peer's side of a butterfly all-reduce over a formed group.

The flattened vector is split into one part per member that has an address (sized by
bandwidth), each part into the group's number of streams (slices of whole chunks). This peer
streams every slice of every other reducer's part to it and takes the average back
(:mod:`averaging.allreduce.sender`) while it reduces the slices of its own part
(:mod:`averaging.allreduce.reducer`), all at once: with ``num_streams`` streams per pair, that many
TCP connections carry each pair's bytes (a long fat or lossy link, where one TCP flow cannot fill
the pipe; see :mod:`averaging.allreduce.streams`). The whole exchange is bounded by
``allreduce_timeout_s``: what is not averaged by then keeps its local values, and the outcome says
so.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from averaging.allreduce.deadlines import Deadlines
from averaging.allreduce.protocol import PartHeader
from averaging.allreduce.reducer import PartReducer
from averaging.allreduce.router import PartRouter
from averaging.allreduce.sender import PartSender
from averaging.config import AveragerConfig
from averaging.matchmaking.group import GroupInfo
from averaging.matchmaking.partition import Part
from averaging.rules.compression import get_codec
from averaging.work import Worker, WorkStats


@dataclass
class AllReduceOutcome:
    """What one peer saw of an all-reduce.

    Attributes:
        total_numel: values in the flattened vector.
        averaged_numel: values replaced by an average that includes another peer's values.
        dropped: peers this peer dropped as their reducer, with the reason.
        failed_parts: reducers whose part did not come back (whole or in part), with the reason.
        late_parts: reducers that had dropped this peer for connecting late: their averages came
            back without its values (its replica still ends equal to the group's).
        timed_out: the all-reduce ran into ``allreduce_timeout_s``.
        stats: bytes moved and CPU seconds spent.
    """

    total_numel: int
    averaged_numel: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    failed_parts: dict[str, str] = field(default_factory=dict)
    late_parts: set[str] = field(default_factory=set)
    timed_out: bool = False
    stats: WorkStats = field(default_factory=WorkStats)

    @property
    def complete(self) -> bool:
        return not (self.dropped or self.failed_parts or self.late_parts or self.timed_out)


async def run_allreduce(
    *,
    transport,
    router: PartRouter,
    stream_name: str,
    group: GroupInfo,
    own_peer_id: str,
    flat: np.ndarray,
    config: AveragerConfig,
    deadlines: Deadlines | None = None,
) -> AllReduceOutcome:
    """Average ``flat`` (float32, 1-D, modified in place) with the rest of ``group``.

    This peer's weight is its entry in ``group``, bounded like everyone's
    (:meth:`GroupInfo.weights`). The waits are ``config``'s; ``deadlines``, when given, is told
    what they measured. Never raises for a peer's failure: the outcome says who was
    dropped and which parts were not averaged.

    Raises:
        ProtocolViolation: the group cannot be partitioned.
    """
    codec = get_codec(group.compression)
    if not codec.is_identity:
        await asyncio.to_thread(codec.prepare)
    outcome = AllReduceOutcome(total_numel=flat.size)
    worker = Worker(outcome.stats, config.offload_min_numel)
    slices = group.stream_parts(flat.size)
    weights = group.weights()
    own_weight = weights[own_peer_id]

    def header(part: Part, weight: float) -> PartHeader:
        return PartHeader(
            group.group_id,
            part.index,
            weight,
            part.numel,
            group.compression,
            part.chunk_numel,
            stream=part.stream,
        )

    reducers = {
        part.stream: PartReducer(
            part=part,
            values=flat[part.start : part.end],
            own_weight=own_weight,
            senders={peer: w for peer, w in weights.items() if peer != own_peer_id},
            header=header(part, 0.0),
            codec=codec,
            config=config,
            worker=worker,
            aggregation=group.aggregation,
            deadlines=deadlines,
        )
        for part in slices[group.index_of(own_peer_id)]
    }
    senders = [
        PartSender(
            transport=transport,
            stream_name=stream_name,
            reducer=member,
            header=header(part, own_weight),
            part=part,
            values=flat[part.start : part.end],
            codec=codec,
            config=config,
            worker=worker,
            deadlines=deadlines,
        )
        for member, parts in zip(group.members, slices, strict=True)
        if member.peer_id != own_peer_id
        for part in parts
    ]
    router.register(group.group_id, reducers)
    tasks = [asyncio.create_task(s.run()) for s in senders]
    tasks += [asyncio.create_task(r.run()) for r in reducers.values()]
    try:
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=config.allreduce_timeout_s)
            outcome.timed_out = bool(pending)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        router.unregister(group.group_id)
        for reducer in reducers.values():
            await reducer.close()
    for task in tasks:  # a failure here is a bug, not a peer's fault: let it surface
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    _collect(outcome, reducers.values(), senders)
    return outcome


def _collect(outcome: AllReduceOutcome, reducers, senders) -> None:
    """Merge every slice's account: a peer dropped, or a part failed, in any slice counts."""
    for reducer in reducers:
        for peer, reason in reducer.dropped.items():
            outcome.dropped.setdefault(peer, reason)
        outcome.averaged_numel += reducer.averaged_numel
    for sender in senders:
        result = sender.result
        outcome.averaged_numel += result.averaged_numel
        if result.error is not None:
            outcome.failed_parts.setdefault(result.reducer, result.error)
        elif result.late:
            outcome.late_parts.add(result.reducer)
        elif not result.done:
            outcome.failed_parts.setdefault(result.reducer, "unfinished at allreduce_timeout_s")
