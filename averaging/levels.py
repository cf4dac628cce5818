"""A round's second level: several rows end the round with one model, the exact global mean.

When the ready peers do not fit in one group, matchmaking forms balanced rows
(:mod:`averaging.matchmaking.rows`) whose leader writes ``top_rows`` into the group. Then:

1. **Row.** The row all-reduces as any group does: every member holds the row's mean ``A_j``,
   of weight ``W_j`` (the sum of the weights averaged).
2. **Top.** The row's delegate (:attr:`GroupInfo.delegate`) looks for the other rows' delegates
   under ``{key}.top`` with weight ``W_j`` and count ``n_j`` (the peers it stands for) and
   all-reduces the row means with them: the weighted mean of the row means, weighted by the row
   weights, is the weighted mean of every peer. One group holds them all: its leader closes once
   the counts sum to ``N`` (the estimate, or the last whole round's count if larger); short of
   that, only after the rows' deadline and ``top_quiet_s`` (:func:`top_sizes`).
3. **Spread.** Every member asks its delegate (the ``spread`` request, a long poll bounded by
   :func:`top_wait_s`) whether the top round averaged; if so the row all-reduces once more,
   over the same members under a group id derived from the row's, where the delegate weighs 1
   and every other member 0: everyone receives the delegate's values (:mod:`averaging.spread`).

Failures are bounded: a top round that does not form or averages nothing leaves every member of
the row with its row mean (the result says so: status "partial", ``levels["top"]``); a delegate
lost during the spread leaves the parts it did not deliver at the row mean (a reducer whose
chunk has no contribution returns none, so the senders keep their values; never 0/0).

Only the weighted mean is exact over two levels: with a robust aggregation the leader writes no
``top_rows`` and the rows stay apart (:meth:`GroupInfo.__post_init__` refuses the mix).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from averaging.config import AveragerConfig, top_weight_ratio
from averaging.matchmaking.group import MAX_COUNT, GroupInfo
from averaging.matchmaking.rows import RoundPlan, SizePlan
from averaging.matchmaking.search import MatchResult, SearchOptions
from averaging.result import RoundResult
from averaging.spread import MAX_REASON_CHARS, Spreads, Word, spread_group

FindGroup = Callable[[str, float, float, SearchOptions], Awaitable[MatchResult]]
AllReduce = Callable[[GroupInfo, float], Awaitable[RoundResult]]


class TopRound(NamedTuple):
    """Where a step's second level meets: the key, the round's plan, and the loop time at
    which this peer's row search would have given up (see :meth:`SecondLevel.run`)."""

    key: str
    plan: RoundPlan | None
    rows_end: float


@dataclass
class SecondLevel:
    """Runs steps 2 and 3 for one peer of a row (see the module docstring).

    Attributes:
        peer_id: this peer.
        spreads: the ``spread`` request's two sides.
        find_group: ``(key, weight, timeout_s, options)``: a search under ``key``.
        allreduce: ``(group, timeout_s)``: an all-reduce of this peer's flat vector, in place.
        config: the averager's settings.
    """

    peer_id: str
    spreads: Spreads
    find_group: FindGroup
    allreduce: AllReduce
    config: AveragerConfig

    async def run(
        self,
        row: GroupInfo,
        row_result: RoundResult,
        *,
        top_key: str,
        plan: RoundPlan | None,
        deadline: float,
        rows_end: float = 0.0,
    ) -> RoundResult:
        """Steps 2 and 3 after the row's all-reduce (``row_result``): the round's result.
        ``rows_end`` is the loop time at which this peer's row search would have given up:
        short of every row, the top round waits at least until then (a row still forming, or
        a peer that found none, comes to the top by then)."""
        loop = asyncio.get_running_loop()
        phase_s: dict[str, float] = {}
        top: RoundResult | None = None
        start = loop.time()
        if self.peer_id == row.delegate:
            try:
                word, top = await self._top(
                    row, row_result, top_key, plan, (deadline, rows_end), phase_s
                )
                self.spreads.answer(row.group_id, word)
            finally:  # (cancelled or a bug: the members must not wait for nothing)
                self.spreads.answer(row.group_id, Word(False, "failed", "the top round ended"))
        else:
            # the delegate's top round may wait for the rows still forming (see top_search_s)
            rows_left_s = max(0.0, rows_end - loop.time())
            wait_s = rows_left_s + top_wait_s(self.config)
            word = await self.spreads.ask(row, min(wait_s, deadline - loop.time()))
            phase_s["spread_wait"] = loop.time() - start
        spread = None
        if word.go:
            spread = await self.allreduce(spread_group(row), max(0.001, deadline - loop.time()))
            phase_s["spread"] = spread.allreduce_s
        return merged(row_result, word, top, spread, phase_s)

    async def solo(
        self,
        weight: float,
        *,
        top_key: str,
        plan: RoundPlan,
        top_rows: int,
        deadline: float,
        rows_end: float = 0.0,
    ) -> RoundResult:
        """A peer that found no row takes part in the top round as a row of its own ("alone",
        and why, if it found no top group either)."""
        loop = asyncio.get_running_loop()
        rows_left_s = max(0.0, rows_end - loop.time())
        budget_s = min(rows_left_s + self.config.top_round_timeout_s, deadline - loop.time())
        end = loop.time() + budget_s
        options = SearchOptions(
            sizes=top_sizes(top_rows, plan, self.config, rows_left_s),
            max_weight_ratio=top_weight_ratio(self.config),
            with_partners=False,
        )
        start = loop.time()
        timeout_s = top_search_s(self.config, rows_left_s, budget_s, 0.0)
        match = await self.find_group(top_key, weight, timeout_s, options)
        matchmaking_s = loop.time() - start
        if match.group is None:
            return RoundResult("alone", f"no top group either: {match.reason}"[:MAX_REASON_CHARS])
        top = await self.allreduce(match.group, top_allreduce_s(self.config, end, deadline))
        reached = sum(match.group.member(p).count for p in top.averaged_with)
        return dataclasses.replace(
            top,
            num_reached=max(1, min(reached, MAX_COUNT)) if top.averaged else 1,
            levels={"row": "alone", "top": top.status},
            phase_s={**top.phase_s, "top_matchmaking": matchmaking_s},
        )

    async def _top(
        self,
        row: GroupInfo,
        row_result: RoundResult,
        top_key: str,
        plan: RoundPlan | None,
        bounds: tuple[float, float],
        phase_s: dict[str, float],
    ) -> tuple[Word, RoundResult | None]:
        if not row_result.averaged:
            return Word(False, "failed", "the row's all-reduce failed at the delegate"), None
        loop = asyncio.get_running_loop()
        deadline, rows_end = bounds
        averaged = row_result.averaged_with
        weight = sum(row_result.weights.get(p, 0.0) for p in averaged)
        if weight <= 0:
            return Word(False, "failed", "the row has no weight"), None
        remaining_s = deadline - loop.time()
        rows_left_s = max(0.0, rows_end - loop.time())
        # leave the spread (an exchange like the row's) time to run within the step's bound
        spread_reserve_s = max(2 * row_result.allreduce_s, remaining_s / 4)
        budget_s = min(
            rows_left_s + self.config.top_round_timeout_s, remaining_s - spread_reserve_s
        )
        end = loop.time() + budget_s
        options = SearchOptions(
            # the last row comes after its own all-reduce: quiet for about as long as ours
            sizes=top_sizes(
                row.top_rows, plan, self.config, rows_left_s, 2 * row_result.allreduce_s
            ),
            max_weight_ratio=top_weight_ratio(self.config),
            count=max(1, min(MAX_COUNT, len(averaged))),
            with_partners=False,  # every delegate must meet every other
        )
        timeout_s = top_search_s(self.config, rows_left_s, budget_s, row_result.allreduce_s)
        start = loop.time()
        match = await self.find_group(top_key, weight, timeout_s, options)
        phase_s["top_matchmaking"] = loop.time() - start
        if match.group is None:
            return Word(False, "alone", f"the top round found no group: {match.reason}"), None
        top = await self.allreduce(
            match.group, top_allreduce_s(self.config, end, deadline - spread_reserve_s)
        )
        phase_s["top_allreduce"] = top.allreduce_s
        if not top.averaged:
            return Word(False, top.status, f"top round: {top.reason}"), top
        reached = sum(match.group.member(p).count for p in top.averaged_with)
        return Word(True, top.status, top.reason, min(reached, MAX_COUNT)), top


def top_wait_s(config: AveragerConfig) -> float:
    """How long past the rows' end a member waits for its delegate's word: the top round's
    search, its all-reduce (:func:`top_allreduce_s`) and the answer's trip."""
    return config.top_round_timeout_s + config.allreduce_timeout_s + config.request_timeout_s


def top_allreduce_s(config: AveragerConfig, end: float, latest: float) -> float:
    """The top all-reduce's bound from now: ``allreduce_timeout_s`` or the top round's ``end``,
    whichever is later, never past ``latest`` (the step's deadline less the spread's time).

    Bounded by each delegate's ``end`` (its rows' end plus ``top_round_timeout_s``), the
    delegates of one top group stopped at different moments: their steps started up to 36 s
    apart at 256 busy peers, so a delegate whose row formed early closed its part of the
    all-reduce while the others' parts were on their way ("the round is over"), and the rows
    kept up to 41 means. Every member gets about the same bound this way."""
    now = asyncio.get_running_loop().time()
    return max(0.001, min(max(config.allreduce_timeout_s, end - now), latest - now))


def top_search_s(
    config: AveragerConfig, rows_left_s: float, budget_s: float, exchange_s: float
) -> float:
    """How long a delegate looks for the top group: the matchmaking time counted from the end
    of the rows' searches (``rows_left_s`` from now), within the top round's ``budget_s`` less
    the time its all-reduce takes (about twice the row's, ``exchange_s``); never shorter than
    the matchmaking time within the budget.

    Counted from now instead (as before), a delegate whose row formed early gave up, or closed
    the top group it led, before rows still forming came: at 256 peers, where rows form over
    the whole matchmaking time, two in five rows found the top group gone or none.
    """
    search_s = min(rows_left_s + config.matchmaking_time_s, budget_s - 2 * exchange_s)
    return max(0.001, min(config.matchmaking_time_s, budget_s), search_s)


def top_sizes(
    top_rows: int,
    plan: RoundPlan | None,
    config: AveragerConfig,
    rows_left_s: float,
    min_quiet_s: float = 0.0,
) -> SizePlan:
    """The delegates' search (:meth:`RoundPlan.top_sizes`): one group that closes once the
    delegates' counts sum to this peer's ``N`` (and every delegate seen is in, or none arrived
    for the quiet time); short of that, only once the row searches are over (``rows_left_s``
    from now, at least ``row_grace_s``), every delegate seen is in and none arrived for
    ``top_quiet_s`` since then (at least ``min_quiet_s``: a row closed at the end of its
    search comes after its all-reduce). Without a plan (a row given to
    :meth:`step_in_group`), at the rows the group expects too."""
    grace_s = max(config.row_grace_s, rows_left_s)
    quiet_s = max(config.top_quiet_s, min_quiet_s)
    if plan is not None:
        return dataclasses.replace(plan.top_sizes(quiet_s), grace_s=grace_s)
    target = max(2, top_rows)
    return SizePlan(target, 2, grace_s, wait_for_seen=True, quiet_s=quiet_s)


def merged(
    row: RoundResult,
    word: Word,
    top: RoundResult | None,
    spread: RoundResult | None,
    phase_s: Mapping[str, float],
) -> RoundResult:
    """One result for the whole round: the row's (its group, members, weights), with the bytes,
    seconds and outcome of every level this peer ran."""
    ran = [r for r in (row, top, spread) if r is not None]
    levels = {"row": row.status, "top": word.top}
    times = dict(row.phase_s)
    for result in ran[1:]:
        for phase, seconds in result.phase_s.items():
            times[phase] = times.get(phase, 0.0) + seconds
    times.update(phase_s)
    times["allreduce"] = row.allreduce_s + sum(
        phase_s.get(p, 0.0) for p in ("top_allreduce", "spread_wait", "spread")
    )
    changes: dict[str, Any] = {
        "bytes_sent": sum(r.bytes_sent for r in ran),
        "bytes_received": sum(r.bytes_received for r in ran),
        "allreduce_s": times["allreduce"],
        "phase_s": times,
        "dropped_peers": tuple(
            dict.fromkeys([*row.dropped_peers, *(spread.dropped_peers if spread else ())])
        ),
        "num_reached": max(1, len(row.averaged_with)) if row.averaged else 1,
        "levels": levels,
    }
    if not word.go:  # keep the row mean
        if row.averaged:
            reason = f"top round {word.top}: {word.reason}; kept the row mean"
            changes.update(status="partial", reason=_joined(row.reason, reason))
        return dataclasses.replace(row, **changes)
    levels["spread"] = spread.status
    # the delegate holds the top round's values whatever the spread did; a member holds them
    # where the spread delivered them, and its row mean elsewhere
    holds_top = top is not None or spread.status == "ok"
    everything_ok = row.status == word.top == spread.status == "ok"
    reasons = [row.reason, f"top round {word.top}: {word.reason}" if word.reason else ""]
    if spread.status != "ok":
        reasons.append(f"spread {spread.status}: {spread.reason}")
    changes.update(status="ok" if everything_ok else "partial", reason=_joined(*reasons))
    if holds_top:
        changes["num_reached"] = max(changes["num_reached"], word.num_reached)
    changes["averaged_fraction"] = (top or spread).averaged_fraction
    return dataclasses.replace(row, **changes)


def _joined(*reasons: str) -> str:
    return "; ".join(r for r in reasons if r)
