"""How a reducer combines the contributions to one chunk: the weighted mean, or a robust rule.

``mean`` (the default) is the weighted mean: exact, streamed (each contribution is added as it
arrives), and as poisonable as any mean, within the weight bounds of :mod:`averaging.bounds`.

The robust rules keep every contribution to a chunk until all have arrived (memory: the group
size times ``chunk_numel`` float32 values per chunk in flight), then:

* ``trimmed_mean``: coordinate by coordinate, drop the ``b`` largest and ``b`` smallest of the
  ``k`` contributions and average the rest, each counting once (``b = max(1, k // 4)`` from
  ``k = 3`` on, so three contributions give their median; fewer are averaged plainly). Up to
  ``b`` arbitrary contributions move no coordinate outside the range of the honest ones.
* ``centered_clip``: CenteredClip (Karimireddy, He and Jaggi, 2021): from the trimmed mean
  ``v`` (the coordinate-wise median of three or four), ``CLIP_ITERATIONS`` times
  ``v += sum_i w_i * min(1, tau / |x_i - v|) * (x_i - v) / sum_i w_i``, with ``tau`` the median
  distance ``|x_i - v|`` of the chunk: a contribution far from the others pulls by at most
  ``tau``, however far it is.

Both are meant for ``grad`` mode (averaging gradients); with fewer than three contributions they
cannot tell a liar from an honest peer and give the weighted mean.
"""

from __future__ import annotations

import enum

import numpy as np

CLIP_ITERATIONS = 3
# Up to this many contributions the trimmed mean moves values with whole-row min/max operations
# (fast, vectorized); more are sorted along the contributions (numpy's strided sort).
BUBBLE_MAX_ROWS = 12


class Aggregation(enum.StrEnum):
    """How reducers combine contributions (a group uses its leader's; members check it)."""

    MEAN = "mean"
    TRIMMED_MEAN = "trimmed_mean"
    CENTERED_CLIP = "centered_clip"


def num_trimmed(num_contributions: int) -> int:
    """Contributions dropped at each end of every coordinate by the trimmed mean."""
    return 0 if num_contributions < 3 else max(1, num_contributions // 4)


def _combine(coefficients: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out = sum_i coefficients[i] * rows[i]``, row by row (numpy's vector-matrix product is
    several times slower for a few long rows)."""
    np.multiply(rows[0], np.float32(coefficients[0]), out=out)
    scratch = np.empty_like(out)
    for coefficient, row in zip(coefficients[1:], rows[1:], strict=True):
        np.multiply(row, np.float32(coefficient), out=scratch)
        out += scratch


def weighted_mean(rows: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """``out = sum_i weights[i] * rows[i] / sum(weights)`` (float32 rows, float64 weights)."""
    _combine(weights / weights.sum(), rows, out)


def _trim_in_place(rows: np.ndarray, b: int) -> None:
    """Move, coordinate by coordinate, the ``b`` smallest values of ``rows`` (k x m) into its
    first ``b`` rows and the ``b`` largest into its last ``b`` (the middle is unordered)."""
    k = rows.shape[0]
    if k > BUBBLE_MAX_ROWS:
        rows.sort(axis=0)  # strided: slow, but O(k log k) compare-exchanges
        return
    scratch = np.empty_like(rows[0])
    for j in range(b):  # one bubble up for the largest, one down for the smallest: row ops
        top = k - 1 - j
        for i in range(j, top):
            np.minimum(rows[i], rows[i + 1], out=scratch)
            np.maximum(rows[i], rows[i + 1], out=rows[i + 1])
            rows[i] = scratch
        for i in range(top - 1, j, -1):
            np.maximum(rows[i - 1], rows[i], out=scratch)
            np.minimum(rows[i - 1], rows[i], out=rows[i - 1])
            rows[i] = scratch


def trimmed_mean(rows: np.ndarray, out: np.ndarray) -> None:
    """The coordinate-wise trimmed mean of ``rows`` (k x m) into ``out`` (m); see the module
    docstring. ``rows`` is reordered in place, coordinate by coordinate."""
    k = rows.shape[0]
    b = num_trimmed(k)
    _trim_in_place(rows, b)
    np.mean(rows[b : k - b], axis=0, out=out)


def centered_clip(rows: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """CenteredClip of ``rows`` (k x m) with ``weights`` (k) into ``out`` (m), from the
    trimmed mean (the median for three or four contributions)."""
    share = weights / weights.sum()
    trimmed_mean(rows.copy(), out)
    diffs, step = np.empty_like(rows), np.empty_like(out)
    for _ in range(CLIP_ITERATIONS):
        np.subtract(rows, out, out=diffs)
        # distances of the differences scaled into [-1, 1]: no square overflows float32, and
        # the clipping factors tau / distance do not depend on the scale
        scale = float(max(diffs.max(), -diffs.min()))
        if not scale > 0:
            return  # every contribution equals the center
        diffs *= np.float32(1 / scale)
        distances = np.sqrt(np.array([np.dot(d, d) for d in diffs], dtype=np.float64))
        tau = float(np.median(distances))
        if tau <= 0:
            return  # most contributions agree exactly: the center is the answer
        clipped = np.minimum(1.0, tau / np.maximum(distances, 1e-300))
        _combine(share * clipped * scale, diffs, step)
        out += step


def aggregate(
    aggregation: Aggregation, rows: np.ndarray, weights: np.ndarray, out: np.ndarray
) -> None:
    """Combine ``rows`` (one contribution each, k x m float32, k >= 1) into ``out``."""
    if aggregation is Aggregation.MEAN or rows.shape[0] < 3:
        weighted_mean(rows, weights, out)
    elif aggregation is Aggregation.TRIMMED_MEAN:
        trimmed_mean(rows, out)
    else:
        centered_clip(rows, weights, out)
