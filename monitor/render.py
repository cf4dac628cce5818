"""The dashboard's sections as rich renderables, each a known number of lines tall.

:func:`render_dashboard` lays them out for a terminal of ``width`` x ``height``: one column below
120 columns (fits 80x24), two side by side above (peers with more columns, rounds beside the loss
chart, alerts beside the local peer's phases). Rows that do not fit are counted in a "+N more"
line instead of scrolling off. Without a height (``--once`` into a pipe) everything is shown.
A swarm with more peers than rows gets the overview of :mod:`monitor.crowd` (a summary, peers per
epoch, the peers needing attention first) and, live, the whole peer table a page at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from monitor.crowd import (
    attention_caption,
    attention_order,
    clamp_offset,
    histogram_rows,
    is_crowd,
    page_caption,
    page_rows,
    render_histogram,
    render_summary,
    table_order,
)
from monitor.layout import is_wide, plan
from monitor.panels import (
    render_local_lines,
    render_local_panel,
    render_loss_chart,
    render_loss_line,
    render_rounds,
)
from monitor.state import Alert, PeerView, SwarmView
from monitor.widgets import bar_legend, fit_line, fmt_bytes, fmt_count, fmt_seconds, phase_bar

HEAD = "bold reverse"
_ALERT_STYLE = {"info": ("•", "cyan"), "warning": ("▲", "yellow"), "error": ("✖", "bold red")}


def _address(peer: PeerView) -> str:
    if peer.address is None:
        return "client"
    if peer.path == "relayed":  # {relay}/v2/relay/{peer id}: the relay is what says something
        return "via " + peer.address.split("://", 1)[-1].split("/", 1)[0]
    return peer.address.split("://", 1)[-1]


_PATH_STYLE = {"direct": "", "relayed": "yellow", "client": "cyan"}


# ---- header ------------------------------------------------------------------------------------


def render_header(
    view: SwarmView, width: int, *, wide: bool, summary: list[Text] | None = None
) -> RenderableType:
    """The run at a glance (one line, or ``summary``'s lines for a big swarm), and a line with
    the epoch's progress toward the target batch size."""
    title = Text("Volunteer Peer · " if wide else "", style="bold")
    kinds = [f"{view.num_clients} client{'s' * (view.num_clients != 1)}"] * bool(view.num_clients)
    kinds += [f"{view.num_relayed} relayed"] * bool(view.num_relayed)
    kinds_text = f" ({', '.join(kinds)})" if kinds else ""
    title.append(f"run {view.run_id}", style="bold")
    title.append(
        f" · epoch {view.epoch} · {view.num_peers} peers"
        f"{kinds_text} · {fmt_count(view.samples_per_s)} samples/s · "
        f"{view.num_rounds} rounds, {view.num_failed_rounds} failed"
    )
    if wide and view.loss is not None:
        title.append(f" · loss {view.loss:.3f}")
    heads = summary if summary is not None else [fit_line(title, width)]
    fraction = view.progress_fraction
    if fraction is None:
        progress = fit_line(
            f"epoch {view.epoch}: {view.samples_accumulated:,} samples (target not published yet)",
            width,
        )
        return Group(*heads, progress)
    target = view.target_batch_size or 0
    status = (
        f" {view.samples_accumulated:,}/{target:,} samples {fraction:.0%} · "
        f"ETA {fmt_seconds(view.eta_s)}"
    )
    bar_width = max(10, min(60, width - len(status) - 1))
    grid = Table.grid()
    grid.add_column(width=bar_width)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    grid.add_row(
        ProgressBar(total=target, completed=view.samples_accumulated, width=bar_width),
        Text(status),
    )
    return Group(*heads, grid)


# ---- peers -------------------------------------------------------------------------------------


def render_peers(
    view: SwarmView,
    max_rows: int | None,
    *,
    wide: bool,
    peers: Sequence[PeerView] | None = None,
) -> Table:
    """The peers table: one header line and at most ``max_rows`` lines (more columns when
    ``wide``), the last one "+N more peers" when they do not fit; ``peers`` in the order shown
    (default: the local peer, then by id)."""
    table = Table(box=None, header_style=HEAD, pad_edge=False, padding=(0, 1), expand=wide)
    bar_width = 20 if wide else 10
    # narrow: the address says the path (an address, "via RELAY" or "client")
    columns = ["peer", "address", *(["path"] if wide else []), "device", "epoch", "smp/s"]
    columns += ["samples", "loss"] if wide else []
    columns += ["data/comp/comm/idle" if wide else "phases", "B/s", "seen"]
    columns += ["cpu", "rss", "notes"] if wide else []
    for name in columns:
        table.add_column(
            name,
            no_wrap=True,
            overflow="ellipsis",
            justify="left" if name in ("peer", "address", "device", "notes") else "right",
            min_width=bar_width if name in ("phases", "data/comp/comm/idle") else None,
            max_width={"address": 21 if not wide else 28}.get(name),
            ratio=1 if name == "notes" else None,
        )
    peers = table_order(view) if peers is None else list(peers)
    shown = peers if max_rows is None or len(peers) <= max_rows else peers[: max(0, max_rows - 1)]
    for peer in shown:
        table.add_row(*_peer_cells(peer, view, wide, bar_width), style=_peer_style(peer))
    if len(shown) < len(peers):
        table.add_row(Text(f"+{len(peers) - len(shown)} more peers", style="dim"))
    if not peers:
        table.add_row(Text("no peers yet", style="dim"))
    return table


def _peer_style(peer: PeerView) -> str:
    if peer.stale:
        return "dim"
    return "bold" if peer.local else ""


def _peer_cells(peer: PeerView, view: SwarmView, wide: bool, bar_width: int) -> list:
    profile = peer.profile
    epoch = Text(str(peer.epoch))
    if peer.behind:
        epoch = Text(f"{peer.epoch}-{view.epoch - peer.epoch}", style="yellow")
    if peer.replica_differs:  # its state is not its group's: red, whatever else
        epoch.stylize("bold red")
    rate = Text(fmt_count(peer.samples_per_s), style="yellow" if peer.straggler else "")
    seen = Text(fmt_seconds(peer.age_s), style="red" if peer.stale else "")
    name = Text(("*" if peer.local else "") + peer.short_id)
    sent = (profile.sent_bytes_per_s + profile.recv_bytes_per_s) if profile else math.nan
    cells = [name, _address(peer)]
    cells += [Text(peer.path, style=_PATH_STYLE[peer.path])] if wide else []
    cells += [profile.device if profile else "-", epoch, rate]
    if wide:
        loss = profile.loss if profile and profile.loss is not None else None
        cells += [f"{peer.samples:,}", "-" if loss is None else f"{loss:.3f}"]
    bar = phase_bar(profile.group_fractions() if profile else None, bar_width)
    cells += [bar, fmt_bytes(sent), seen]
    if wide:
        notes = [
            word
            for flag, word in (
                (peer.local, "this peer"),
                (peer.behind, "behind"),
                (peer.straggler, "straggler"),
                (peer.stale, "out of date"),
                (peer.replica_differs, "replica differs"),
            )
            if flag
        ]
        if profile and profile.bottleneck != "balanced":
            notes.append(f"{profile.bottleneck}-bound")
        cells += [
            f"{profile.cpu_percent:.0f}%" if profile else "-",
            fmt_bytes(profile.rss_bytes) if profile else "-",
            ", ".join(notes),
        ]
    return cells


# ---- loss, verdict, alerts ---------------------------------------------------------------------


def render_verdict(view: SwarmView, width: int) -> Text:
    """One line: the swarm's bottleneck, the peers agreeing, the mean group shares."""
    verdict = view.verdict
    if verdict is None:
        return fit_line(Text("bottleneck: no profile records yet", style="dim"), width)
    line = Text("bottleneck ", style="bold")
    line.append(verdict.bottleneck, style="bold magenta")
    line.append(f" ({verdict.num_agree}/{verdict.num_profiled} peers) ")
    line.append_text(phase_bar(verdict.fractions, 10))
    shares = " ".join(f"{name} {share:.0%}" for name, share in verdict.fractions.items())
    line.append(f" {shares}")
    if verdict.example:
        line.append(f" · {verdict.example}", style="dim")
    return fit_line(line, width)


def render_alerts(alerts: tuple[Alert, ...], width: int, max_rows: int | None) -> Group:
    shown = alerts if max_rows is None else alerts[:max_rows]
    lines = []
    for alert in shown:
        glyph, style = _ALERT_STYLE.get(alert.level, ("•", ""))
        lines.append(fit_line(Text(f"{glyph} {alert.text}", style=style), width))
    if len(shown) < len(alerts) and lines:
        more = Text(f"  +{len(alerts) - len(shown) + 1} more alerts", style="dim")
        lines[-1] = fit_line(more, width)
    return Group(*lines)


# ---- the whole screen --------------------------------------------------------------------------


def render_dashboard(
    view: SwarmView,
    *,
    width: int,
    height: int | None = None,
    footer: str = "",
    peers_offset: int | None = None,
) -> RenderableType:
    """The dashboard for a ``width`` x ``height`` terminal (no height: show every row).

    A swarm with more peers than rows gets the big swarm's overview (:mod:`monitor.crowd`);
    there, ``peers_offset`` (the live view's scrolling) shows a page of the whole peer table
    from that row instead.
    """
    crowd = is_crowd(view, width, height)
    if crowd and height is not None and peers_offset is not None:
        return _render_page(view, width, height, footer, peers_offset)
    local = view.local_peer_id is not None
    summary = render_summary(view, width) if crowd else None
    num_histogram = histogram_rows(view, height) if crowd else 0
    caption = crowd and height is not None  # without a height every peer is listed
    budget = plan(
        width=width,
        height=height,
        local=local,
        num_peers=len(view.peers),
        num_rounds=len(view.rounds),
        num_alerts=len(view.alerts),
        extra_lines=(len(summary) - 1 + num_histogram + caption) if summary else 0,
    )
    wide = budget.wide
    parts: list[RenderableType] = [render_header(view, width, wide=wide, summary=summary)]
    if crowd:
        parts.append(render_histogram(view, width, num_histogram))
    if local and not wide:
        parts.append(render_local_lines(view, width))
    if caption:  # the peers that need a look first; the keys page through all of them
        rows = budget.peers or 1
        shown = view.num_peers if view.num_peers <= rows else rows - 1
        parts.append(attention_caption(shown, view.num_peers, width))
        parts.append(render_peers(view, rows, wide=wide, peers=attention_order(view)))
    else:
        parts.append(render_peers(view, budget.peers, wide=wide))
    if wide:
        left = max(60, width * 11 // 20)
        parts.append(
            _side_by_side(
                render_rounds(view, budget.rounds, wide=True),
                render_loss_chart(view, width - left - 2, budget.chart_rows),
                left,
            )
        )
        parts.append(render_verdict(view, width))
        right = render_local_panel(view, width - left - 2) if local else Text("")
        parts.append(_side_by_side(render_alerts(view.alerts, left, budget.alerts), right, left))
    else:
        parts += [
            render_rounds(view, budget.rounds, wide=False),
            render_loss_line(view, width),
            render_verdict(view, width),
            render_alerts(view.alerts, width, budget.alerts),
        ]
    parts.append(_footer(view, width, footer))
    return Group(*parts)


def _render_page(view: SwarmView, width: int, height: int, footer: str, offset: int) -> Group:
    """The summary, then one page of the whole peer table from row ``offset``."""
    rows = page_rows(view, width, height)
    peers = table_order(view)
    first = clamp_offset(offset, len(peers), rows)
    page = peers[first : first + rows]
    wide = is_wide(width, height)
    return Group(
        render_header(view, width, wide=wide, summary=render_summary(view, width)),
        page_caption(first + 1, first + len(page), len(peers), width),
        render_peers(view, rows, wide=wide, peers=page),
        _footer(view, width, footer),
    )


def _side_by_side(left: RenderableType, right: RenderableType, left_width: int) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(width=left_width, no_wrap=True)
    grid.add_column(no_wrap=True, ratio=1)
    grid.add_row(left, right)
    return grid


def _footer(view: SwarmView, width: int, footer: str) -> Text:
    if view.error:
        return fit_line(Text(f"DHT read failed: {view.error} (retrying)", style="bold red"), width)
    legend = bar_legend()
    legend.append(f" {footer}", style="dim")
    return fit_line(legend, width)


class Dashboard:
    """A live renderable: lays the newest view out for the console's current size.

    Args:
        get_view: the newest view (None until the first read).
        footer: text for the last line (key help, when the view was read).
        get_offset: the first row of the whole peer table shown (a big swarm's live view);
            None shows the overview.
    """

    def __init__(
        self,
        get_view: Callable[[], SwarmView | None],
        footer: Callable[[], str],
        get_offset: Callable[[], int | None] = lambda: None,
    ):
        self._get_view = get_view
        self._footer = footer
        self._get_offset = get_offset

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        view = self._get_view()
        if view is None:
            yield Text(f"reading the swarm's records... {self._footer()}", style="dim")
            return
        height = options.height or console.height
        yield render_dashboard(
            view,
            width=options.max_width,
            height=height,
            footer=self._footer(),
            peers_offset=self._get_offset(),
        )


def plain_line(view: SwarmView) -> str:
    """One log line per interval when stdout is not a terminal."""
    stamp = time.strftime("%H:%M:%S", time.localtime(view.time))
    target = f"/{view.target_batch_size}" if view.target_batch_size else ""
    parts = [
        f"{stamp} run={view.run_id} epoch={view.epoch}",
        f"samples={view.samples_accumulated}{target}",
        f"eta_s={view.eta_s:.1f}" if math.isfinite(view.eta_s) else "eta_s=-",
        f"peers={view.num_peers} clients={view.num_clients}",
        f"samples_per_s={view.samples_per_s:.1f}",
        f"rounds={view.num_rounds} failed={view.num_failed_rounds}",
        f"loss={view.loss:.4f}" if view.loss is not None else "loss=-",
        f"bottleneck={view.verdict.bottleneck if view.verdict else '-'}",
    ]
    differ = [peer.short_id for peer in view.peers if peer.replica_differs]
    if differ:
        parts.append(f"replicas_differ={','.join(differ)}")
    if view.alerts:
        parts.append(f"alert={view.alerts[0].text!r}")
    if view.error:
        parts.append(f"error={view.error!r}")
    return " ".join(parts)
