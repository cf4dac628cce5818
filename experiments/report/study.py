"""The study's reading of a sweep: seeds pooled with their spread, fairness, findings.

What a reviewer asks of a comparison, computed from the same results as the summary table:

* **Repeats.** Configurations that differ only in their seed form a group; every figure is
  shown as the mean over seeds with its min-max spread (``12.3 [11.0-13.5]``), and a difference
  whose spreads overlap is marked ``noise``. One seed gives no spread and says so.
* **The tuned baseline** and fairness: see :mod:`experiments.report.fairness`.
* **Statistical efficiency.** Samples to the target loss beside seconds to it: a swarm can be
  faster in samples/s yet need more samples (larger effective batch, stale updates).
* **Findings.** For each swept factor, the mean time to target at each of its values; the
  factor whose best and worst values differ most moved time to target most, by that ratio
  (noise when the seeds' spreads of the two values overlap).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from experiments.analysis import ConfigResult
from peer.profiling.summary import VERDICT_GROUPS, group_shares

_SEED = re.compile(r"_?seed-\d+$")


@dataclasses.dataclass(frozen=True)
class Spread:
    """A figure over seeds: mean, min, max and how many seeds gave it."""

    mean: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread | None:
        present = [float(v) for v in values if v is not None]
        if not present:
            return None
        return cls(statistics.fmean(present), min(present), max(present), len(present))

    def overlaps(self, other: Spread) -> bool:
        """Whether the two min-max ranges meet (single seeds: only when equal)."""
        return self.low <= other.high and other.low <= self.high

    def text(self, digits: int = 1) -> str:
        if self.count < 2:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"


def spread_text(spread: Spread | None, digits: int = 1) -> str:
    return "-" if spread is None else spread.text(digits)


@dataclasses.dataclass(frozen=True)
class Group:
    """The seeds of one configuration."""

    key: str
    results: list[ConfigResult]
    rows: list[dict[str, Any]]

    @property
    def baseline(self) -> bool:
        return self.results[0].baseline

    @property
    def grid(self) -> dict[str, Any]:
        return self.results[0].grid

    def spread(self, column: str) -> Spread | None:
        return Spread.of(row[column] for row in self.rows)

    def spread_of(self, value: Callable[[ConfigResult], float | None]) -> Spread | None:
        return Spread.of(value(result) for result in self.results)


def group_key(name: str) -> str:
    """A configuration's name without its seed (``baseline`` for the baselines)."""
    return _SEED.sub("", name) or "swarm"


def make_groups(results: list[ConfigResult], rows: list[dict[str, Any]]) -> list[Group]:
    """Results grouped by configuration across seeds, baselines first, in report order."""
    groups: dict[str, tuple[list[ConfigResult], list[dict[str, Any]]]] = {}
    for result, row in zip(results, rows, strict=True):
        found = groups.setdefault(group_key(result.name), ([], []))
        found[0].append(result)
        found[1].append(row)
    return [Group(key, rs, rows) for key, (rs, rows) in groups.items()]


def samples_to_target(result: ConfigResult, target: float | None) -> float | None:
    """Samples all processes had trained when the loss first reached ``target``."""
    if target is None:
        return None
    return next((float(p.samples) for p in result.curve if p.loss <= target), None)


def per_cpu(row: dict[str, Any], total_cpus: int) -> float | None:
    rate = row.get("samples_per_s")
    return None if not rate else float(rate) / total_cpus


def compare(config: Spread | None, baseline: Spread | None, *, lower_is_better: bool) -> str:
    """``faster``/``slower`` than the baseline (``lower_is_better``: a time), ``noise`` when
    the spreads of two or more seeds each overlap."""
    if config is not None and baseline is None and lower_is_better:
        return "faster (the baseline never reached it)"
    if config is None or baseline is None:
        return "-"
    if config.count >= 2 and baseline.count >= 2 and config.overlaps(baseline):
        return "noise"
    better = config.mean < baseline.mean if lower_is_better else config.mean > baseline.mean
    suffix = "" if config.count >= 2 and baseline.count >= 2 else " (1 seed)"
    return ("faster" if better else "slower") + suffix


# ---------------------------------------------------------------------------------------------
# Sections of report.md


def study_lines(groups: list[Group], target: float | None, total_cpus: int) -> list[str]:
    """The seed-pooled table: time and samples to target, speedup, per-CPU rate, phases."""
    baseline = next((g for g in groups if g.baseline), None)
    base_time = baseline.spread("time_to_target_s") if baseline else None
    header = [
        "config", "reached", "time to target s", "vs baseline", "speedup", "samples to target",
        "samples/s per CPU", "final loss", "data %", "compute %", "comm %", "swarm %", "bound",
    ]  # fmt: skip
    rows = []
    for group in groups:
        time_to = group.spread("time_to_target_s")
        shares = [
            group_shares(r.swarm.seconds, r.swarm.wall_s) for r in group.results if r.swarm.wall_s
        ]
        bounds = sorted({r.swarm.verdict().bottleneck for r in group.results if r.swarm.wall_s})
        rows.append(
            [
                group.key,
                _reached(group),
                spread_text(time_to),
                "-" if group.baseline else compare(time_to, base_time, lower_is_better=True),
                spread_text(group.spread("speedup"), 2),
                spread_text(group.spread_of(lambda r: samples_to_target(r, target)), 0),
                spread_text(Spread.of(per_cpu(row, total_cpus) for row in group.rows)),
                spread_text(group.spread("final_loss"), 4),
                *(
                    spread_text(Spread.of(100 * s[name] for s in shares))
                    for name in ("data", "compute", "communication", "swarm")
                ),
                "/".join(bounds) or "-",
            ]
        )
    groups_text = ", ".join(f"{g} = {'+'.join(p)}" for g, p in VERDICT_GROUPS.items())
    note = (
        "Mean over seeds [min-max]; `reached`: seeds whose run reached the target loss (the "
        "time and samples to target are over those). `vs baseline`: time to target compared "
        "with the tuned baseline's; `noise` where the two min-max ranges overlap. Phase shares "
        f"are % of all peer-seconds ({groups_text})."
    )
    return ["## Study: seeds pooled", "", note, "", *table(header, rows), "", *load_lines(groups)]


def load_lines(groups: list[Group]) -> list[str]:
    """The machine's load while the configurations ran (from their status files)."""
    loads = [value for group in groups for result in group.results for value in result.load_average]
    if not loads:
        return []
    cpus = os.cpu_count() or 1
    verdict = (
        "above the CPU count: other work shared the CPUs, so rates and times carry its noise "
        "(the seeds' spread shows how much)"
        if max(loads) > cpus
        else "at most the CPU count"
    )
    return [
        f"Machine load (1-minute load average at each configuration's start and end): "
        f"{min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs, {verdict}.",
        "",
    ]


def decomposition_lines(groups: list[Group], target: float | None) -> list[str]:
    """Each speedup split exactly into fewer samples to the target (statistical efficiency) and
    more samples per second on the way there (hardware efficiency):
    ``T_b / T_c = (S_b / S_c) x ((S_c / T_c) / (S_b / T_b))`` per seed, with S samples and T
    seconds to target, b the same seed's baseline and c the configuration."""
    baselines = {r.seed: r for g in groups if g.baseline for r in g.results}
    header = ["config", "speedup", "x fewer samples", "x faster samples/s", "mostly from"]
    rows = []
    for group in (g for g in groups if not g.baseline):
        parts = [_split(r, baselines.get(r.seed), target) for r in group.results]
        parts = [p for p in parts if p is not None]
        if not parts:
            continue
        statistical = Spread.of(p[0] for p in parts)
        hardware = Spread.of(p[1] for p in parts)
        speedup = Spread.of(p[0] * p[1] for p in parts)
        assert statistical is not None and hardware is not None
        source = "fewer samples" if statistical.mean > hardware.mean else "throughput"
        rows.append(
            [group.key, spread_text(speedup, 2), statistical.text(2), hardware.text(2), source]
        )
    if not rows:
        return []
    note = (
        "Speedup = (the baseline's samples to target / the configuration's) x (its samples/s "
        "on the way to the target / the baseline's), per seed. A speedup from fewer samples "
        "comes from the optimisation (e.g. local updates take more, smaller steps per sample), "
        "which a single node could also get with other hyperparameters; one from throughput "
        "comes from the system."
    )
    return ["## Where the speedup comes from", "", note, "", *table(header, rows), ""]


def _split(
    result: ConfigResult, baseline: ConfigResult | None, target: float | None
) -> tuple[float, float] | None:
    if baseline is None:
        return None
    s_c, s_b = samples_to_target(result, target), samples_to_target(baseline, target)
    t_c, t_b = result.time_to_target_s, baseline.time_to_target_s
    if not (s_c and s_b and t_c and t_b):
        return None
    return s_b / s_c, (s_c / t_c) / (s_b / t_b)


def _reached(group: Group) -> str:
    reached = sum(r.time_to_target_s is not None for r in group.results)
    return f"{reached}/{len(group.results)}"


def _level_means(groups: list[Group], factor: str) -> dict[str, dict[int, list[float]]]:
    """Factor value -> seed -> times to target of the configurations with that value."""
    levels: dict[str, dict[int, list[float]]] = {}
    for group in groups:
        if group.baseline or factor not in group.grid:
            continue
        by_seed = levels.setdefault(str(group.grid[factor]), {})
        for result in group.results:
            if result.time_to_target_s is not None:
                by_seed.setdefault(result.seed, []).append(result.time_to_target_s)
    return levels


def findings_lines(groups: list[Group], factors: list[str]) -> list[str]:
    """Which factor moved time to target most, and by how much (from the numbers)."""
    lines = ["## Findings", ""]
    effects = []
    for factor in factors:
        levels = _level_means(groups, factor)
        spreads = {
            value: Spread.of(statistics.fmean(ts) for ts in by_seed.values())
            for value, by_seed in levels.items()
        }
        reached = {v: s for v, s in spreads.items() if s is not None}
        if len(reached) < 2:
            continue
        best = min(reached, key=lambda v: reached[v].mean)
        worst = max(reached, key=lambda v: reached[v].mean)
        ratio = reached[worst].mean / reached[best].mean
        noise = (
            reached[best].overlaps(reached[worst])
            and min(reached[best].count, reached[worst].count) >= 2
        )
        effects.append((ratio, factor, best, worst, reached, noise))
    if not effects:
        return [*lines, "No swept factor had two values that both reached the target loss.", ""]
    effects.sort(reverse=True)
    for rank, (ratio, factor, best, worst, reached, noise) in enumerate(effects, start=1):
        verdict = "within the seeds' spread: noise" if noise else "beyond the seeds' spread"
        if min(reached[best].count, reached[worst].count) < 2:
            verdict = "one seed: spread unknown"
        lead = "moved time to target most" if rank == 1 else "moved it"
        lines.append(
            f"{rank}. **{factor}** {lead}: {factor} = {best} reached the target in "
            f"{reached[best].text()} s, {factor} = {worst} in {reached[worst].text()} s "
            f"({ratio:.2f}x; {verdict})."
        )
    lines.append("")
    return lines + _speedup_finding(groups)


def _speedup_finding(groups: list[Group]) -> list[str]:
    swarms = [g for g in groups if not g.baseline and g.spread("speedup") is not None]
    if not swarms:
        return _lower_bound_finding(groups)
    best = max(swarms, key=lambda g: g.spread("speedup").mean)  # type: ignore[union-attr]
    speedup = best.spread("speedup")
    assert speedup is not None
    where = "faster" if speedup.mean > 1 else "slower"
    noise = speedup.count >= 2 and speedup.low <= 1.0 <= speedup.high
    tail = "; the spread includes 1.0: noise" if noise else ""
    bound = sorted({r.swarm.verdict().text for r in best.results if r.swarm.wall_s})
    return [
        f"The best swarm configuration, `{best.key}`, reached the target with a speedup of "
        f"{speedup.text(2)} over the tuned baseline ({where}{tail}).",
        f"Where its time went: {bound[0] if bound else '-'}.",
        "",
    ]


def _lower_bound_finding(groups: list[Group]) -> list[str]:
    """Without a baseline time to target: a lower bound on the speedup when the swarm got there."""
    baseline = next((g for g in groups if g.baseline), None)
    reached = [g for g in groups if not g.baseline and g.spread("time_to_target_s") is not None]
    if baseline is None or baseline.spread("time_to_target_s") is not None or not reached:
        return ["No swarm configuration and the baseline both reached the target loss.", ""]
    best = min(reached, key=lambda g: g.spread("time_to_target_s").mean)  # type: ignore[union-attr]
    time_to = best.spread("time_to_target_s")
    wall = baseline.spread_of(lambda r: r.swarm.wall_s)
    loss = baseline.spread("final_loss")
    assert time_to is not None and wall is not None
    return [
        f"The baseline never reached the target loss (it trained {wall.text()} s and ended at "
        f"loss {spread_text(loss, 4)}); `{best.key}` reached it in {time_to.text()} s: a "
        f"speedup of at least {wall.mean / time_to.mean:.2f}x, if the baseline was fair (see "
        "Fairness).",
        "",
    ]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
