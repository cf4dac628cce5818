"""Small text pieces of the dashboard: number formats, the stacked phase bar, sparklines and a
multi-row loss chart. Every piece has a fixed width (no wrapping), so the layout can count lines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rich.text import Text

# The dashboard's four phase groups: glyph and colour of each (distinct glyphs stay readable
# without colour).
GROUP_STYLE: dict[str, tuple[str, str]] = {
    "data": ("▒", "blue"),
    "compute": ("█", "green"),
    "comm": ("▓", "magenta"),
    "idle": ("░", "bright_black"),
}
SPARK = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▁▂▃▄▅▆▇█"


def fmt_count(value: float) -> str:
    """A count or rate in at most 5 characters: ``812``, ``12.3``, ``4.5k``, ``1.2M``."""
    if not math.isfinite(value):
        return "-"
    magnitude = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            scaled = value / limit
            return f"{scaled:.1f}{suffix}" if abs(scaled) < 100 else f"{scaled:.0f}{suffix}"
    return f"{value:.1f}" if 0 < magnitude < 100 and value != int(value) else f"{value:.0f}"


def fmt_bytes(value: float) -> str:
    """Bytes with a binary unit: ``812B``, ``4.5K``, ``1.2M``, ``3.0G``."""
    if not math.isfinite(value):
        return "-"
    for limit, suffix in ((2**30, "G"), (2**20, "M"), (2**10, "K")):
        if value >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}B"


def fmt_seconds(value: float) -> str:
    """A duration: ``0.42s``, ``12s``, ``3m05s``, ``2h10m``; ``-`` when unknown."""
    if not math.isfinite(value) or value < 0:
        return "-"
    if value < 10:
        return f"{value:.2f}s" if value < 1 else f"{value:.1f}s"
    if value < 60:
        return f"{value:.0f}s"
    if value < 3600:
        return f"{int(value // 60)}m{int(value % 60):02d}s"
    return f"{int(value // 3600)}h{int(value % 3600 // 60):02d}m"


def split_cells(shares: Sequence[float], width: int) -> list[int]:
    """Cells per share (largest remainder), summing to ``width`` times the shares' total
    (at most 1)."""
    total = min(1.0, sum(max(0.0, s) for s in shares))
    filled = round(total * width)
    if filled == 0 or total == 0:
        return [0] * len(shares)
    exact = [max(0.0, s) / total * filled for s in shares]
    cells = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in by_remainder[: filled - sum(cells)]:
        cells[i] += 1
    return cells


def phase_bar(groups: Mapping[str, float] | None, width: int) -> Text:
    """The stacked data/compute/comm/idle bar (``width`` cells); dots without a profile.

    Time outside the four groups (rounding) is left blank at the end.
    """
    if groups is None:
        return Text("·" * width, style="bright_black")
    cells = split_cells([groups.get(name, 0.0) for name in GROUP_STYLE], width)
    bar = Text()
    for (glyph, style), count in zip(GROUP_STYLE.values(), cells, strict=True):
        bar.append(glyph * count, style=style)
    bar.append(" " * (width - sum(cells)))
    return bar


def bar_legend() -> Text:
    legend = Text()
    for name, (glyph, style) in GROUP_STYLE.items():
        legend.append(glyph, style=style)
        legend.append(f"{name} ")
    return legend


def resample(points: Sequence[tuple[float, float]], num_bins: int) -> list[float | None]:
    """``num_bins`` values evenly spaced in time over the points' span (each bin: its last
    point, or the previous bin's value)."""
    if not points or num_bins < 1:
        return []
    points = sorted(points, key=lambda point: point[0])  # peers' clocks need not agree
    start, end = points[0][0], points[-1][0]
    if end <= start:
        return [points[-1][1]] * min(num_bins, len(points))
    values: list[float | None] = [None] * num_bins
    for t, value in points:
        index = min(num_bins - 1, max(0, int((t - start) / (end - start) * num_bins)))
        values[index] = value
    last = None
    for i, value in enumerate(values):
        last = value if value is not None else last
        values[i] = last
    return values


def sparkline(values: Sequence[float | None], low: float, high: float) -> str:
    """One row of eighth blocks; ``None`` is a blank."""
    span = high - low
    out = []
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(" ")
            continue
        level = 0 if span <= 0 else (value - low) / span
        out.append(SPARK[min(len(SPARK) - 1, max(0, round(level * (len(SPARK) - 1))))])
    return "".join(out)


def column_chart(values: Sequence[float | None], low: float, high: float, rows: int) -> list[str]:
    """A chart ``rows`` tall, one column per value, in eighth blocks (top row first)."""
    span = high - low
    heights = []
    for value in values:
        if value is None or not math.isfinite(value):
            heights.append(0)
        else:
            level = 1.0 if span <= 0 else (value - low) / span
            heights.append(max(1, round(level * rows * 8)))  # at least a sliver: a real point
    lines = []
    for row in range(rows - 1, -1, -1):
        line = []
        for height in heights:
            filled = min(8, max(0, height - row * 8))
            line.append(_EIGHTHS[filled])
        lines.append("".join(line))
    return lines


def fit_line(text: Text | str, width: int) -> Text:
    """``text`` as one line of at most ``width`` cells (an ellipsis where it is cut)."""
    line = text if isinstance(text, Text) else Text(text)
    line.no_wrap, line.overflow = True, "ellipsis"
    line.truncate(width, overflow="ellipsis")
    return line
