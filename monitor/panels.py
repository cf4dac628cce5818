"""The dashboard's panels that draw over time or about one peer: the rounds, the loss (a
one-line sparkline or a multi-row chart) and the local peer's phases (``peer join
--dashboard``)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from monitor.crowd import MAX_GROUP_CLASSES, fmt_groups
from monitor.state import RoundRow, SwarmView
from monitor.widgets import (
    column_chart,
    fit_line,
    fmt_bytes,
    fmt_count,
    fmt_seconds,
    resample,
    sparkline,
)
from peer.records.profile import PROFILE_PHASES

HEAD = "bold reverse"
_STATUS_STYLE = {"ok": "green", "partial": "yellow", "alone": "cyan", "failed": "bold red"}
_PHASE_ABBREV = {
    "data": "data",
    "h2d": "h2d",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "opt",
    "matchmaking": "mm",
    "allreduce": "ar",
    "state_sync": "sync",
    "idle": "idle",
    "cpu_wait": "cpuw",
    "other": "other",
}


# ---- rounds ------------------------------------------------------------------------------------


def render_rounds(view: SwarmView, max_rows: int | None, *, wide: bool) -> RenderableType:
    """The last rounds, newest first: one header line and at most ``max_rows`` lines."""
    if not view.rounds:
        return Text("rounds: none reported yet", style="dim")
    table = Table(box=None, header_style=HEAD, pad_edge=False, padding=(0, 1))
    columns = ["round", "group", "time", "bytes", "drop", "avg", "local", "status"]
    columns += ["loss", "ended"] if wide else []
    for name in columns:
        table.add_column(
            name, no_wrap=True, justify="left" if name in ("status", "group") else "right"
        )
    rows = view.rounds if max_rows is None else view.rounds[:max_rows]
    for row in rows:
        table.add_row(*_round_cells(row, view, wide))
    return table


def _round_cells(row: RoundRow, view: SwarmView, wide: bool) -> list:
    if not row.group_sizes:  # nobody averaged in this epoch
        group = "alone"
    else:
        group = fmt_groups(row.group_sizes, row.num_swarm_peers)
    if wide and 0 < len(row.group_sizes) <= MAX_GROUP_CLASSES:  # of many, the largest says little
        group += f" {row.swarm_share:.0%}"
    cells = [
        str(row.epoch),
        group,
        fmt_seconds(row.duration_s),
        fmt_bytes(row.sent_bytes),
        Text(str(row.num_dropped), style="yellow" if row.num_dropped else ""),
        f"{row.averaged_fraction:.0%}",
        Text(str(row.num_local), style="yellow" if row.num_local else ""),
        Text(row.status, style=_STATUS_STYLE.get(row.status, "")),
    ]
    if wide:
        cells += [
            "-" if row.loss is None else f"{row.loss:.3f}",
            fmt_seconds(max(0.0, view.time - row.end_time)) + " ago",
        ]
    return cells


def _loss_range(view: SwarmView) -> tuple[list[float | None], float, float, float] | None:
    points = view.loss_history
    if not points:
        return None
    values = [v for _, v in points]
    return values, min(values), max(values), points[-1][0] - points[0][0]


def render_loss_line(view: SwarmView, width: int) -> Text:
    """One line: the loss now and a sparkline of it over time."""
    found = _loss_range(view)
    if found is None:
        return fit_line(Text("loss: no reports yet", style="dim"), width)
    _, low, high, span_s = found
    first, last = view.loss_history[0][1], view.loss_history[-1][1]
    prefix = f"loss {last:.3f} "
    suffix = f" {first:.3g}→{last:.3g} in {fmt_seconds(span_s)}"
    spark_width = max(1, width - len(prefix) - len(suffix))
    line = Text(prefix, style="bold")
    line.append(sparkline(resample(view.loss_history, spark_width), low, high), style="cyan")
    line.append(suffix)
    return fit_line(line, width)


def render_loss_chart(view: SwarmView, width: int, rows: int) -> RenderableType:
    """A title line, ``rows`` chart lines with the range on the left, and a time line."""
    found = _loss_range(view)
    if found is None:
        return Text("loss: no reports yet", style="dim")
    _, low, high, span_s = found
    label_width = max(len(f"{high:.3g}"), len(f"{low:.3g}")) + 1
    chart_width = max(4, width - label_width)
    values = resample(view.loss_history, chart_width)
    lines = column_chart(values, low, high, rows)
    out = [Text(f"loss over time (now {view.loss_history[-1][1]:.4g})", style="bold")]
    for index, chart_line in enumerate(lines):
        label = f"{high:.3g}" if index == 0 else f"{low:.3g}" if index == rows - 1 else ""
        line = Text(label.rjust(label_width - 1) + " ", style="dim")
        line.append(chart_line, style="cyan")
        out.append(fit_line(line, width))
    footer = f"-{fmt_seconds(span_s)}".ljust(chart_width - 3) + "now"
    out.append(fit_line(Text(" " * label_width + footer, style="dim"), width))
    return Group(*out)


# ---- this peer (peer join --dashboard) ---------------------------------------------------------


def render_local_lines(view: SwarmView, width: int) -> Group:
    """Two lines about the local peer: its numbers, and its ten phases in percent."""
    peer = view.peer(view.local_peer_id)
    if peer is None:
        return Group(
            fit_line(Text("this peer: not in the progress records yet", style="dim"), width)
        )
    log = peer.rounds
    head = Text(f"this peer {peer.short_id}", style="bold")
    head.append(f" · epoch {peer.epoch} · {fmt_count(peer.samples_per_s)} samples/s")
    if log is not None:
        head.append(
            f" · rounds {log.num_rounds} ({log.num_failed_rounds} failed, "
            f"{log.num_local_steps} local)"
        )
    if peer.profile is not None and peer.profile.loss is not None:
        head.append(f" · loss {peer.profile.loss:.3f}")
    if peer.profile is None:
        phases = Text("phases: waiting for this peer's first profile record", style="dim")
    else:
        phases = Text("phases ")
        fractions = peer.profile.fractions
        phases.append(
            " ".join(f"{_PHASE_ABBREV[p]} {fractions.get(p, 0.0):.0%}" for p in PROFILE_PHASES)
        )
    return Group(fit_line(head, width), fit_line(phases, width))


def render_local_panel(view: SwarmView, width: int) -> Group:
    """The local peer's phase breakdown, one bar per phase (``LOCAL_PANEL_LINES`` lines)."""
    peer = view.peer(view.local_peer_id)
    lines = [render_local_lines(view, width).renderables[0]]
    fractions = peer.profile.fractions if peer is not None and peer.profile else {}
    bar_width = max(5, width - 20)
    for phase in PROFILE_PHASES:
        share = fractions.get(phase, 0.0)
        cells = round(min(1.0, share) * bar_width)
        line = Text(f"{phase:<12}")
        line.append("█" * cells, style="green")
        line.append("·" * (bar_width - cells), style="bright_black")
        line.append(f" {share:4.0%}")
        lines.append(fit_line(line, width))
    if peer is not None and peer.profile is not None and peer.profile.verdict:
        lines.append(fit_line(Text(peer.profile.verdict, style="dim"), width))
    return Group(*lines)
