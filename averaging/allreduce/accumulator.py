"""A reducer's chunks in flight: where contributions wait until a chunk is averaged.

:class:`MeanWindow` adds each weighted contribution into one float32 slot per chunk as it
arrives (the weighted mean, streamed). :class:`RobustWindow` keeps every contribution in a row of
its own and combines them with a robust rule (:mod:`averaging.rules.robust`) once all have arrived.
Either way a contribution is checked before it counts: every weighted value within
:func:`averaging.bounds.value_limit` (NaN and Inf fail too), so no sum of them overflows, and the
average is checked again before anyone gets it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from averaging.bounds import FLOAT32_MAX
from averaging.errors import BadChunkError
from averaging.rules.robust import Aggregation, aggregate


def within(values: np.ndarray, limit: float) -> bool:
    """Whether every value is finite with magnitude at most ``limit`` (two passes, no copy)."""
    if not values.size:
        return True
    return bool(-limit <= values.min() and values.max() <= limit)


def checked(values: np.ndarray, limit: float) -> np.ndarray:
    """``values`` if :func:`within` ``limit``, else :class:`BadChunkError`."""
    if not within(values, limit):
        raise BadChunkError(f"chunk holds NaN, Inf or weighted values beyond {limit:.3g}")
    return values


class MeanWindow:
    """Weighted sums of ``window`` chunks in flight, one float32 slot each.

    Args:
        window: chunks in flight.
        chunk_numel: values per chunk.
        limit: the largest magnitude of one weighted contribution.
    """

    weighted_decode = True  # contributions arrive multiplied by their weight

    def __init__(self, window: int, chunk_numel: int, limit: float):
        self._window = window
        self._limit = limit
        self._acc = np.empty((window, chunk_numel), dtype=np.float32)

    def open(self, chunk: int, own: np.ndarray, own_weight: float) -> bool:
        """Start ``chunk`` with this peer's values; False if they do not count (0 weight, or
        beyond the limit once weighted)."""
        slot = self._acc[chunk % self._window, : own.size]
        if own_weight > 0:
            with np.errstate(over="ignore", invalid="ignore"):
                np.multiply(own, np.float32(own_weight), out=slot)
            if within(slot, self._limit):
                return True
        slot.fill(0.0)
        return False

    def add(self, chunk: int, index: int, values: np.ndarray, weight: float) -> None:
        """Add a weighted contribution (already :func:`checked`)."""
        slot = self._acc[chunk % self._window, : values.size]
        np.add(slot, values, out=slot)

    def average(self, chunk: int, size: int, total_weight: float) -> np.ndarray | None:
        """The average of ``chunk`` (a view, valid until the slot is opened again), or None if
        it is not finite."""
        slot = self._acc[chunk % self._window, :size]
        slot *= np.float32(1 / total_weight)
        return slot if within(slot, FLOAT32_MAX) else None


class RobustWindow:
    """Every contribution of ``window`` chunks in flight, one row per contributor.

    Args:
        window: chunks in flight.
        chunk_numel: values per chunk.
        num_rows: contributors (this peer and every sender), each with a fixed row index.
        limit: the largest magnitude of one contribution.
        aggregation: the robust rule.
    """

    weighted_decode = False  # contributions arrive as sent; weights are the rule's business

    def __init__(
        self, window: int, chunk_numel: int, num_rows: int, limit: float, aggregation: Aggregation
    ):
        self._window = window
        self._limit = limit
        self._aggregation = aggregation
        self._rows = np.empty((window, num_rows, chunk_numel), dtype=np.float32)
        self._weights = np.zeros((window, num_rows), dtype=np.float64)
        self._out = np.empty((window, chunk_numel), dtype=np.float32)

    def open(self, chunk: int, own: np.ndarray, own_weight: float) -> bool:
        weights = self._weights[chunk % self._window]
        weights.fill(0.0)
        if own_weight > 0 and within(own, self._limit):
            self._rows[chunk % self._window, 0, : own.size] = own
            weights[0] = own_weight
            return True
        return False

    def add(self, chunk: int, index: int, values: np.ndarray, weight: float) -> None:
        """Keep a contribution (already :func:`checked`) in row ``index`` (1 + sender index)."""
        self._rows[chunk % self._window, index, : values.size] = values
        self._weights[chunk % self._window, index] = weight

    def average(self, chunk: int, size: int, total_weight: float) -> np.ndarray | None:
        weights = self._weights[chunk % self._window]
        present = np.flatnonzero(weights > 0)
        rows = self._rows[chunk % self._window, present, :size]  # a copy: free to sort
        out = self._out[chunk % self._window, :size]
        aggregate(self._aggregation, rows, weights[present], out)
        return out if within(out, FLOAT32_MAX) else None


def make_window(
    aggregation: Aggregation,
    *,
    window: int,
    chunk_numel: int,
    senders: Sequence[str],
    limit: float,
) -> MeanWindow | RobustWindow:
    """The window for ``aggregation``: row 0 is this peer's, row ``1 + i`` is ``senders[i]``'s."""
    if aggregation is Aggregation.MEAN:
        return MeanWindow(window, chunk_numel, limit)
    return RobustWindow(window, chunk_numel, 1 + len(senders), limit, aggregation)
