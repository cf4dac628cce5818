"""How many rows each section of the dashboard gets on a terminal of a given height.

The sections have known heights (see :mod:`monitor.render`): the header 2 lines, a table one
header line plus its rows, the footer 1 line. :func:`plan` shares the lines left over between
peers, rounds and alerts so that the whole screen fits: peers first (they are the point), a few
rounds and alerts always when there are any, the rest to whoever has more to show.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.records.profile import PROFILE_PHASES

# The two-column layout needs this many columns and lines.
WIDE_MIN_COLUMNS = 120
WIDE_MIN_LINES = 30
# Lines of the local peer's panel in the two-column layout: its line, the phases, its verdict.
LOCAL_PANEL_LINES = len(PROFILE_PHASES) + 2
MIN_ROUNDS, MIN_ALERTS = 3, 2


@dataclass(frozen=True)
class Budget:
    """Rows per section; None means "all of them" (no height limit).

    Attributes:
        wide: the two-column layout.
        peers: lines of the peers table under its header ("+N more" included).
        rounds: rounds shown.
        alerts: alert lines.
        chart_rows: height of the loss chart (two-column layout).
    """

    wide: bool
    peers: int | None
    rounds: int | None
    alerts: int | None
    chart_rows: int = 8


def is_wide(width: int, height: int | None) -> bool:
    return width >= WIDE_MIN_COLUMNS and (height is None or height >= WIDE_MIN_LINES)


def plan(
    *,
    width: int,
    height: int | None,
    local: bool,
    num_peers: int,
    num_rounds: int,
    num_alerts: int,
    extra_lines: int = 0,
) -> Budget:
    """The rows of each section for a ``width`` x ``height`` screen (see the module doc);
    ``extra_lines``: lines taken by sections of a big swarm (:mod:`monitor.crowd`)."""
    wide = is_wide(width, height)
    if height is None:
        return Budget(wide, None, None, None)
    peers_wanted = max(1, num_peers)
    if wide:
        return _plan_wide(height - extra_lines, local, peers_wanted, num_rounds, num_alerts)
    # header 2, peers header 1, rounds (header or "none yet") 1, loss 1, verdict 1, footer 1
    fixed = 7 + (2 if local else 0) + extra_lines
    available = max(1, height - fixed)
    rounds_min, alerts_min = min(num_rounds, MIN_ROUNDS), min(num_alerts, MIN_ALERTS)
    peers = min(peers_wanted, max(1, available - rounds_min - alerts_min))
    left = max(0, available - peers)
    rounds = min(num_rounds, max(0, left - alerts_min))
    alerts = min(num_alerts, max(0, left - rounds))
    return Budget(False, peers, rounds, alerts)


def _plan_wide(
    height: int, local: bool, peers_wanted: int, num_rounds: int, num_alerts: int
) -> Budget:
    # header 2, peers header 1, verdict 1, footer 1
    available = height - 5
    beside_local = LOCAL_PANEL_LINES if local else 0
    alerts_min = min(num_alerts, MIN_ALERTS)
    bottom_min = max(alerts_min, beside_local)
    # the chart gives up rows (down to 3) before the peers' table would have none
    chart_rows = max(3, min(10, available // 4, available - bottom_min - 3))
    beside_chart = chart_rows + 2  # the chart's title and time lines
    peers = min(peers_wanted, max(1, available - beside_chart - bottom_min))
    left = max(0, available - peers - beside_chart - bottom_min)
    rounds = min(num_rounds, beside_chart - 1)  # the table's header is one of the lines
    extra = min(num_rounds - rounds, left)
    rounds, left = rounds + extra, left - extra
    alerts = min(num_alerts, max(bottom_min, alerts_min + left))
    return Budget(True, peers, rounds, alerts, chart_rows)
