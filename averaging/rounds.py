"""From a step's arguments to its searches, and from an all-reduce's outcome to a result."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from averaging.allreduce.butterfly import AllReduceOutcome
from averaging.config import AveragerConfig
from averaging.errors import ConfigError
from averaging.matchmaking.group import MAX_GROUP_SIZE, GroupInfo
from averaging.matchmaking.rows import RoundPlan, SizePlan, bucket_key, bucket_of
from averaging.matchmaking.search import SearchOptions
from averaging.result import RoundResult
from averaging.rules.robust import Aggregation


def round_plan(
    config: AveragerConfig,
    expected_peers: int | None,
    target_group_size: int | None,
    layout_peers: int | None = None,
) -> RoundPlan | None:
    """How a round of ``expected_peers`` goes (None: unknown, groups as the config says), its
    matchmaking keys laid out for ``layout_peers`` when given (:class:`LayoutMemory`)."""
    if expected_peers is None:
        return None
    try:
        if isinstance(expected_peers, bool):
            raise TypeError
        expected_peers = operator.index(expected_peers)  # numpy integers too
    except TypeError:
        raise ConfigError(f"expected_peers must be an integer, got {expected_peers!r}") from None
    if expected_peers < 1:
        raise ConfigError(f"expected_peers must be >= 1, got {expected_peers}")
    group_size = min(target_group_size or config.target_group_size, MAX_GROUP_SIZE)
    return RoundPlan.of(expected_peers, group_size, config.row_grace_s, layout_peers)


@dataclass
class LayoutMemory:
    """How many peers this peer's last whole round reached, for the next round's key layout.

    A peer sizes its matchmaking key's buckets from a count of the swarm
    (:func:`averaging.matchmaking.rows.num_buckets`). Its own estimate of ``N`` differs from
    its neighbours', most on a busy host, and estimates on both sides of an edge of the layout
    put peers under different keys: more, smaller rows (the simulation at 64 busy peers: 1
    bucket in 45 searches, 2 in 142). Every member of a round that averaged the whole swarm
    holds the same count (the top round's word, or the one group's size; one that lost a part
    may hold a little less), so the next epoch's
    round lays its keys out for that count, and its top round waits for at least that many
    (:meth:`averaging.matchmaking.rows.RoundPlan.top_sizes`), while the estimate still sizes
    the rows; a round
    that was not whole, a skipped epoch, or a count under half the estimate (the swarm grew)
    leaves the estimate to choose.

    A count above the estimate, however far, is kept: an estimate lags low where epochs are
    short. The records of the peers outside this peer's row still say the last epoch when it
    counts the next one (its partners' are advanced by its own round), so with epochs of a
    fraction of a second every peer of 32 in rows of 16, 9, 5 and 2 counted its own row and
    planned one group of it: four models. Kept at 32, the rows meet at the top; where the swarm
    did shrink, the top round closes short of the count after its quiet time, and that round's
    count is the next one's.
    """

    epoch: int | None = None
    num_reached: int = 0

    def layout_peers(self, epoch: int | None, expected_peers: int | None) -> int | None:
        """The count to lay out the round at ``epoch`` for (None: the estimate's)."""
        if epoch is None or expected_peers is None or self.epoch != epoch - 1:
            return None
        if 2 * self.num_reached < expected_peers:
            return None
        return self.num_reached

    def note(self, epoch: int | None, result: RoundResult) -> None:
        """Remember the count ``result`` of the round at ``epoch`` reached, when its last level
        averaged: a part lost on the way ("partial") still leaves the count of the peers
        reached. Forgetting it there, a row of 16 of 32 peers that lost one part planned the
        next epoch as one group of its own, and the swarm split in two for good. A top round
        that did not average leaves nothing to remember (its row's count is not the swarm's)."""
        top = result.levels.get("top")
        whole = result.averaged and top in (None, "ok", "partial") and result.num_reached > 1
        self.epoch, self.num_reached = (epoch, result.num_reached) if whole else (None, 0)


def row_search(
    config: AveragerConfig, peer_id: str, base: str, plan: RoundPlan | None, seed: str = ""
) -> tuple[str, SearchOptions | None]:
    """The key and sizes of this peer's first-level search; ``seed`` places peers in buckets
    (``base`` when empty)."""
    if plan is None:
        return base, None
    if plan.single:  # one group holds every ready peer: close once they are all in
        target = max(config.min_group_size, plan.num_peers)
        if plan.whole_peers > target:  # at most group_size: the plan is single
            # an estimate short of the last whole round's count lags (see LayoutMemory): wait
            # for that count, or past the grace for the estimate's once nobody new comes; at
            # 16 light peers that started 2.5 s apart, estimates of 4-7 closed groups of 7, 5
            # and 4, three models
            grace_s = config.row_grace_s
            sizes = SizePlan(plan.whole_peers, target, grace_s, quiet_s=grace_s)
            return base, SearchOptions(sizes=sizes)
        return base, SearchOptions(sizes=SizePlan(target))
    exact = config.aggregation is Aggregation.MEAN  # see averaging.levels
    top_rows = min(plan.num_rows, MAX_GROUP_SIZE) if exact else 0
    seed = seed or base
    under_key = None
    if plan.buckets > 1:  # partners of other buckets never come here
        mine = bucket_of(seed, peer_id, plan.buckets)
        under_key = functools.partial(_in_bucket, seed, plan.buckets, mine)
    options = SearchOptions(sizes=plan.row_sizes(), top_rows=top_rows, under_key=under_key)
    return bucket_key(base, peer_id, plan.buckets, seed), options


def _in_bucket(seed: str, buckets: int, bucket: int, peer_id: str) -> bool:
    return bucket_of(seed, peer_id, buckets) == bucket


def result_of(
    group: GroupInfo, outcome: AllReduceOutcome, phase_s: dict[str, float]
) -> RoundResult:
    """The result of one all-reduce over ``group`` as this peer saw it (``outcome``)."""
    reasons = [f"dropped {p[:8]}: {why}" for p, why in outcome.dropped.items()]
    reasons += [f"part of {p[:8]} lost: {why}" for p, why in outcome.failed_parts.items()]
    reasons += [
        f"late to {p[:8]}: its part came back without our values" for p in outcome.late_parts
    ]
    if outcome.timed_out:
        reasons.append("allreduce_timeout_s reached")
    dropped = tuple(dict.fromkeys([*outcome.dropped, *outcome.failed_parts]))
    if outcome.complete:
        status = "ok"
    elif outcome.averaged_numel:
        status = "partial"
    else:
        status = "failed"
    fraction = outcome.averaged_numel / outcome.total_numel if outcome.total_numel else 1.0
    return RoundResult(
        status,
        "; ".join(reasons),
        group_id=group.group_id,
        members=group.peer_ids,
        weights=group.weights(),
        num_reached=max(1, len(group.members) - len(dropped)) if outcome.averaged_numel else 1,
        dropped_peers=dropped,
        bytes_sent=outcome.stats.bytes_sent,
        bytes_received=outcome.stats.bytes_received,
        allreduce_s=phase_s["allreduce"],
        averaged_fraction=fraction,
        compression=group.compression.value,
        phase_s=dict(phase_s),
        num_streams=group.num_streams,
    )
