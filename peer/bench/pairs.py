"""Paired measurements on a noisy host: interleaved windows and the spread of pairwise ratios.

A shared machine's speed drifts by tens of percent over tens of seconds, more than the effects
the benchmarks look for. Measuring side A for a while and then side B compares two different
machines. Here the two sides take turns in short windows over the same stretch of time, in the
order A B, B A, A B, ... (so that a drift that is linear over a pair hits both sides alike), and
each pair gives one ratio ``B / A``. The median of those ratios ignores the pairs that a burst of
load hit on one side only; their spread (IQR, min-max) says how far one pair can be trusted.

Pure: no torch, no processes; the sides are callables (see :mod:`peer.bench.windows` for the
sides that pause process groups).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

#: measures one side for one window of the given seconds; returns its rate (work per second),
#: or None when the window could not be measured (the pair is then left out)
Measure = Callable[[float], float | None]


@dataclasses.dataclass(frozen=True)
class RatioSpread:
    """The median of pairwise ratios and their spread.

    Attributes:
        ratio_p50: median of the pairwise ratios.
        ratio_iqr: interquartile range (third minus first quartile) of the ratios.
        ratio_min, ratio_max: the smallest and largest ratio.
        num_pairs: how many pairs gave a ratio.
        ratios: every pair's ratio, in the order measured.
    """

    ratio_p50: float
    ratio_iqr: float
    ratio_min: float
    ratio_max: float
    num_pairs: int
    ratios: tuple[float, ...]

    def fields(self, digits: int = 4) -> dict[str, float | int | list[float]]:
        """The JSON fields of a benchmark result (rounded)."""
        return {
            "ratio_p50": round(self.ratio_p50, digits),
            "ratio_iqr": round(self.ratio_iqr, digits),
            "ratio_min": round(self.ratio_min, digits),
            "ratio_max": round(self.ratio_max, digits),
            "num_pairs": self.num_pairs,
            "ratios": [round(r, digits) for r in self.ratios],
        }


def pairwise_ratios(numerators: Sequence[float | None], denominators: Sequence[float | None]):
    """``numerators[i] / denominators[i]`` for every pair where both are measured and the
    denominator is positive.

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators")
    return [
        n / d
        for n, d in zip(numerators, denominators, strict=True)
        if n is not None and d is not None and d > 0
    ]


def quartiles(values: Iterable[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (linear interpolation between order
    statistics, NumPy's default; one value is its own quartiles).

    Raises:
        ValueError: no values.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quartiles of no values")
    if len(ordered) == 1:
        return ordered[0], ordered[0], ordered[0]
    first, median, third = statistics.quantiles(ordered, n=4, method="inclusive")
    return first, median, third


def spread(ratios: Sequence[float]) -> RatioSpread:
    """The median and spread of ``ratios``.

    Raises:
        ValueError: no ratios.
    """
    first, median, third = quartiles(ratios)
    return RatioSpread(
        ratio_p50=median,
        ratio_iqr=third - first,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        num_pairs=len(ratios),
        ratios=tuple(ratios),
    )


def pair_order(num_pairs: int) -> list[tuple[int, int]]:
    """Which side goes first in each pair: (0, 1), (1, 0), (0, 1), ... (A B B A A B ...)."""
    if num_pairs < 1:
        raise ValueError(f"num_pairs must be >= 1, got {num_pairs}")
    return [(0, 1) if index % 2 == 0 else (1, 0) for index in range(num_pairs)]


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """The windows of an interleaved run.

    Attributes:
        rates_a, rates_b: each side's rate per pair (None: that window was not measured).
        spread: the ratios ``b / a`` of the pairs where both were measured.
        window_s: seconds of each window.
    """

    rates_a: tuple[float | None, ...]
    rates_b: tuple[float | None, ...]
    spread: RatioSpread
    window_s: float

    def median_rate(self, side: int) -> float:
        """The median over windows of side 0's (A) or side 1's (B) rate."""
        rates = [r for r in (self.rates_a, self.rates_b)[side] if r is not None]
        return statistics.median(rates)


def interleave(a: Measure, b: Measure, *, num_pairs: int, window_s: float) -> Interleaved:
    """Measure ``a`` and ``b`` in ``num_pairs`` pairs of windows of ``window_s`` seconds each,
    alternating which goes first; ratios are ``b / a``.

    Raises:
        ValueError: bad arguments, or no pair where both windows were measured.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    sides = (a, b)
    rates: tuple[list[float | None], list[float | None]] = ([], [])
    for order in pair_order(num_pairs):
        for side in order:
            rates[side].append(sides[side](window_s))
    ratios = pairwise_ratios(rates[1], rates[0])
    if not ratios:
        raise ValueError("no pair of windows was measured on both sides")
    return Interleaved(tuple(rates[0]), tuple(rates[1]), spread(ratios), window_s)


def paired_runs(
    a: Callable[[], T], b: Callable[[], T], *, num_pairs: int
) -> tuple[list[T], list[T]]:
    """Run ``a`` and ``b`` ``num_pairs`` times each, taking turns (A B B A A B ...): whole short
    runs, for benchmarks whose sides cannot be paused (each run starts its own processes)."""
    sides, results = (a, b), ([], [])
    for order in pair_order(num_pairs):
        for side in order:
            results[side].append(sides[side]())
    return results


def aba(a: Measure, b: Measure, *, seconds: float) -> float | None:
    """The design interleaving replaces, for comparison: ``a`` for half of ``seconds``, ``b``
    for ``seconds``, ``a`` for the other half; returns ``b``'s rate over ``a``'s mean rate."""
    first, middle, last = a(seconds / 2), b(seconds), a(seconds / 2)
    if first is None or middle is None or last is None or first + last <= 0:
        return None
    return middle / ((first + last) / 2)


def rate_between(points: Iterable[tuple[float, float]], start: float, end: float) -> float | None:
    """The rate of a counter sampled at ``points`` = (time, work done since the previous point),
    over the points inside ``[start, end]``: the work of every point after the first one
    inside, over the time between the first and the last one inside.

    Such points are a metrics stream's lines (``t``, ``samples``): the work a line reports was
    done between the previous line and this one, so the first line inside the window counts
    only as the start of the clock. None with fewer than two points inside.
    """
    inside = [(t, work) for t, work in points if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return sum(work for _, work in inside[1:]) / (inside[-1][0] - inside[0][0])
