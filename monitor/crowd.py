"""The dashboard of a big swarm (more peers than rows): a summary, epochs at a glance, the peers
that need attention first, and the whole peer table a page at a time.

A swarm whose peers all fit the terminal keeps the one-row-per-peer view (:mod:`monitor.render`).
Beyond that (:func:`is_crowd`), the header's first line becomes :func:`render_summary` (peers,
epochs min/median/max, samples/s, the peers' rounds by status, peers behind, replicas that
differ), :func:`render_histogram` shows peers per epoch, and the peers table lists the most
behind, flagged and slowest peers first (:func:`attention_order`). The live view pages through
every peer (:func:`page_rows`, keys in :mod:`monitor.keys`); ``--once`` prints every peer.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Group
from rich.text import Text

from monitor.layout import plan
from monitor.view import PeerView, SwarmView
from monitor.widgets import fit_line, fmt_count

# Without a terminal height (``--once``), swarms above this many peers get the summary and the
# histogram on top of the full table (a 24-line terminal shows about this many rows).
ONCE_CROWD_MIN_PEERS = 20
# Lines of the histogram at most (older epochs share the last line).
MAX_HISTOGRAM_ROWS = 4
MAX_HISTOGRAM_BAR = 40
MAX_SUMMARY_LINES = 2
# Distinct group sizes shown per round (the rarer ones are counted as "…").
MAX_GROUP_CLASSES = 3


@dataclass(frozen=True)
class CrowdStats:
    """What the summary line says about a swarm.

    Attributes:
        num_peers: peers with a progress record.
        epoch_min, epoch_median, epoch_max: over the peers' epochs (0 without peers).
        samples_per_s: the swarm's total rate.
        num_ok, num_partial, num_alone, num_failed: the peers' round reports by status, over the
            epochs the view keeps (``SwarmView.rounds``).
        num_behind: peers behind the swarm's epoch.
        num_differ: peers whose replica differs from its group's.
    """

    num_peers: int
    epoch_min: int
    epoch_median: int
    epoch_max: int
    samples_per_s: float
    num_ok: int
    num_partial: int
    num_alone: int
    num_failed: int
    num_behind: int
    num_differ: int


def crowd_stats(view: SwarmView) -> CrowdStats:
    """The summary's numbers for ``view``."""
    epochs = sorted(peer.epoch for peer in view.peers) or [0]
    rows = view.rounds
    return CrowdStats(
        num_peers=view.num_peers,
        epoch_min=epochs[0],
        epoch_median=statistics.median_low(epochs),
        epoch_max=epochs[-1],
        samples_per_s=view.samples_per_s,
        num_ok=sum(row.num_ok for row in rows),
        num_partial=sum(row.num_partial for row in rows),
        num_alone=sum(row.num_local - row.num_failed for row in rows),
        num_failed=sum(row.num_failed for row in rows),
        num_behind=sum(peer.behind for peer in view.peers),
        num_differ=sum(peer.replica_differs for peer in view.peers),
    )


def is_crowd(view: SwarmView, width: int, height: int | None) -> bool:
    """More peers than today's table has rows for at this size (no height: more than
    :data:`ONCE_CROWD_MIN_PEERS`)."""
    if height is None:
        return view.num_peers > ONCE_CROWD_MIN_PEERS
    budget = plan(
        width=width,
        height=height,
        local=view.local_peer_id is not None,
        num_peers=view.num_peers,
        num_rounds=len(view.rounds),
        num_alerts=len(view.alerts),
    )
    return budget.peers is not None and view.num_peers > budget.peers


def attention_order(view: SwarmView) -> list[PeerView]:
    """Peers most in need of a look first: furthest behind, then those whose replica differs,
    then out of date ones, then by rate (slowest first)."""
    return sorted(
        view.peers,
        key=lambda p: (
            p.epoch - view.epoch if p.behind else 0,
            not p.replica_differs,
            not p.stale,
            p.samples_per_s,
            p.peer_id,
        ),
    )


def table_order(view: SwarmView) -> list[PeerView]:
    """Every peer in the table's usual order: the local peer, then by id."""
    return sorted(view.peers, key=lambda p: (not p.local, p.peer_id))


# ---- summary -----------------------------------------------------------------------------------


def _summary_pieces(view: SwarmView) -> list[Text]:
    stats = crowd_stats(view)
    kinds = [f"{view.num_clients} client{'s' * (view.num_clients != 1)}"] * bool(view.num_clients)
    kinds += [f"{view.num_relayed} relayed"] * bool(view.num_relayed)
    rounds = f"rounds {stats.num_ok} ok, {stats.num_partial} partial, {stats.num_failed} failed"
    rounds += f", {stats.num_alone} alone" if stats.num_alone else ""
    return [
        Text(f"run {view.run_id}", style="bold"),
        Text(f"{stats.num_peers} peers" + (f" ({', '.join(kinds)})" if kinds else "")),
        Text(
            f"epoch min {stats.epoch_min} med {stats.epoch_median} max {stats.epoch_max}"
            f" (swarm {view.epoch})"
        ),
        Text(f"{fmt_count(stats.samples_per_s)} samples/s"),
        Text(rounds, style="yellow" if stats.num_failed or stats.num_partial else ""),
        Text(f"{stats.num_behind} behind", style="yellow" if stats.num_behind else ""),
        Text(f"{stats.num_differ} replicas differ", style="bold red" if stats.num_differ else ""),
    ]


def render_summary(view: SwarmView, width: int) -> list[Text]:
    """The swarm in one line (two on a narrow terminal); a piece is never cut in two."""
    lines = [Text()]
    for piece in _summary_pieces(view):
        line = lines[-1]
        gap = " · " if line.plain else ""
        if line.plain and len(line) + len(gap) + len(piece) > width:
            if len(lines) == MAX_SUMMARY_LINES:
                break
            lines.append(Text())
            line, gap = lines[-1], ""
        line.append(gap)
        line.append_text(piece)
    return [fit_line(line, width) for line in lines]


# ---- histogram ---------------------------------------------------------------------------------


def epoch_histogram(peers: Sequence[PeerView], max_rows: int) -> list[tuple[int, bool, int]]:
    """(epoch, or-older, peers) per line, newest epoch first; past ``max_rows`` lines the
    oldest epochs share the last line (``or-older`` set, the epoch its newest)."""
    counts = collections.Counter(peer.epoch for peer in peers)
    epochs = sorted(counts, reverse=True)
    if len(epochs) <= max_rows:
        return [(epoch, False, counts[epoch]) for epoch in epochs]
    head, tail = epochs[: max_rows - 1], epochs[max_rows - 1 :]
    return [(epoch, False, counts[epoch]) for epoch in head] + [
        (tail[0], True, sum(counts[epoch] for epoch in tail))
    ]


def histogram_rows(view: SwarmView, height: int | None) -> int:
    """Lines the histogram takes (all epochs up to :data:`MAX_HISTOGRAM_ROWS`)."""
    distinct = len({peer.epoch for peer in view.peers})
    return min(distinct, MAX_HISTOGRAM_ROWS if height is not None else 2 * MAX_HISTOGRAM_ROWS)


def render_histogram(view: SwarmView, width: int, max_rows: int) -> Group:
    """Peers per epoch, one bar a line: the swarm's epoch green, epochs behind it yellow."""
    bins = epoch_histogram(view.peers, max(1, max_rows))
    largest = max((count for _, _, count in bins), default=1)
    label_width = max((len(str(epoch)) + older for epoch, older, _ in bins), default=1)
    bar_width = max(1, min(MAX_HISTOGRAM_BAR, width - label_width - 24))
    lines = []
    for epoch, older, count in bins:
        style = "green" if epoch == view.epoch else "yellow" if epoch < view.epoch else "cyan"
        label = f"≤{epoch}" if older else str(epoch)
        line = Text(f"epoch {label:>{label_width}} ")
        line.append("█" * max(1, round(count / largest * bar_width)), style=style)
        lag = view.epoch - epoch
        note = f", {lag}{'+' * older} behind" if lag > 0 else ""
        line.append(f" {count} peer{'s' * (count != 1)}{note}")
        lines.append(fit_line(line, width))
    return Group(*lines)


# ---- groups ------------------------------------------------------------------------------------


def fmt_groups(sizes: Sequence[int], num_swarm_peers: int) -> str:
    """A round's groups: ``3+2/5`` (of the swarm's 5 peers) for a few, ``50 groups: 48×4 2×3``
    for many (``48×4``: 48 groups of 4 peers; the peers left out are the round's "local")."""
    if len(sizes) <= MAX_GROUP_CLASSES:
        return f"{'+'.join(str(size) for size in sizes)}/{num_swarm_peers}"
    classes = collections.Counter(sizes).most_common()
    shown = " ".join(f"{count}×{size}" for size, count in classes[:MAX_GROUP_CLASSES])
    shown += " …" if len(classes) > MAX_GROUP_CLASSES else ""
    return f"{len(sizes)} groups: {shown}"


# ---- the whole peer table, a page at a time ----------------------------------------------------


def page_rows(view: SwarmView, width: int, height: int) -> int:
    """Peer rows on one page of the full table: all but the summary, the progress line, the
    caption, the table's header and the footer."""
    return max(1, height - len(render_summary(view, width)) - 4)


def clamp_offset(offset: int, num_peers: int, rows: int) -> int:
    """The first row of a page, so that the last page is full."""
    return max(0, min(offset, num_peers - rows))


def page_caption(first: int, last: int, num_peers: int, width: int) -> Text:
    """``all peers 41–75 of 200`` and the keys that move."""
    line = Text(f"all peers {first}–{last} of {num_peers}", style="bold")
    line.append("  ↑↓ PgUp PgDn Home End scroll · a or Esc: overview", style="dim")
    return fit_line(line, width)


def attention_caption(shown: int, num_peers: int, width: int) -> Text:
    """The title of the overview's peers table."""
    title = f"{shown} of {num_peers} peers: most behind, replica differs, slowest"
    line = Text(title, style="bold")
    line.append("  ↓ or a: all peers", style="dim")
    return fit_line(line, width)
