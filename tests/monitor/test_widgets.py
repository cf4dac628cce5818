"""The dashboard's small pieces: number formats, bar cells, the loss curve's resampling."""

from __future__ import annotations

import math

import pytest

from monitor.widgets import fmt_bytes, fmt_count, fmt_seconds, resample, split_cells

pytestmark = pytest.mark.timeout(30)


def test_formats_fit_in_a_few_characters():
    assert [fmt_count(v) for v in (812, 12.3, 4500, 1.25e6, math.inf)] == [
        "812",
        "12.3",
        "4.5k",
        "1.2M",
        "-",
    ]
    assert [fmt_bytes(v) for v in (812, 4608, 3 * 2**30)] == ["812B", "4.5K", "3.0G"]
    assert [fmt_seconds(v) for v in (0.42, 12, 185, 7800, math.inf)] == [
        "0.42s",
        "12s",
        "3m05s",
        "2h10m",
        "-",
    ]


@pytest.mark.parametrize("width", [1, 7, 10, 20])
def test_bar_cells_add_up_to_the_filled_share(width):
    for shares in ([0.25, 0.25, 0.25, 0.25], [0.05, 0.7, 0.15, 0.1], [0.1, 0.2, 0.0, 0.0]):
        cells = split_cells(shares, width)
        assert sum(cells) == round(min(1.0, sum(shares)) * width)
        assert all(abs(c - s * width) < 1 for c, s in zip(cells, shares, strict=True))


def test_resample_takes_points_in_any_order_and_from_skewed_clocks():
    points = [(10.0, 1.0), (0.0, 3.0), (5.0, 2.0), (12.0, 0.5)]
    values = resample(points, 4)
    assert values == [3.0, 2.0, 2.0, 0.5]
    assert resample([(5.0, 1.0)], 10) == [1.0]
    assert resample([], 5) == []
