"""Phase summaries and the bottleneck verdict, shared by the live profiler, the exit table and
``peer profile summarize`` (torch-free, so reading metrics files stays light).

A :class:`StretchSummary` is what a stretch of wall time (a rolling window, an epoch, a whole run,
a metrics file) was spent on. :func:`diagnose` turns it into a :class:`Verdict`. Compute is the
work a peer is there to do; the other groups are time lost, and the largest of them is the
bottleneck once it holds :data:`LOST_FRACTION` of the wall time, even when compute holds more:

* ``data`` (``data`` + ``h2d``): the loader cannot keep up: more workers, a faster dataset;
* ``communication`` (``matchmaking`` + ``allreduce`` + ``state_sync``): the network or the
  group formation; the all-reduce's rate is the bytes sent in the stretch over its all-reduce
  seconds (DHT traffic included, so it slightly overstates what the all-reduce achieved);
* ``swarm`` (``idle``): waiting for other peers with nothing to do.

Otherwise ``compute`` (``forward`` + ``backward`` + ``optimizer``) if it holds at least
:data:`COMPUTE_FRACTION` (the device is the limit: where a healthy run is), else ``balanced``
(``other``, time outside any phase, counts there).

Time runnable but waiting for a CPU (``cpu_wait``, :mod:`peer.profiling.cpu_wait`) is the host's,
not the workload's: the verdict judges the workload on the time it was not waiting, so the same
run gets the same bottleneck on an idle and on a crowded machine, and CPU contention from
:data:`LOST_FRACTION` of the wall time on is named in the text with what to do about it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rich import box
from rich.table import Table

from peer.records.profile import PROFILE_PHASES

# Time lost to one group (data, communication, swarm) from this share on is the bottleneck.
LOST_FRACTION = 0.25
# Otherwise compute from this share on makes a run compute bound.
COMPUTE_FRACTION = 0.5
VERDICT_GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data", "h2d"),
    "compute": ("forward", "backward", "optimizer"),
    "communication": ("matchmaking", "allreduce", "state_sync"),
    "swarm": ("idle",),
    # the host's, not the workload's: reported, never the bottleneck
    "cpu": ("cpu_wait",),
}
# The groups of time lost, in the order a tie goes.
LOST_GROUPS = ("data", "communication", "swarm")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The bottleneck of a stretch and one sentence of evidence.

    Attributes:
        bottleneck: ``data``, ``compute``, ``communication``, ``swarm`` or ``balanced``.
        text: e.g. ``data-loading bound: 46% of wall time waiting for batches; ...``.
    """

    bottleneck: str
    text: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StretchSummary:
    """What a stretch of wall time went to.

    Attributes:
        wall_s: the stretch's wall time (the sum of ``seconds``).
        seconds: every phase of :data:`PROFILE_PHASES` -> seconds.
        samples: training samples processed.
        sent_bytes, recv_bytes: bytes the transport sent and received.
        cpu_percent: the process's CPU use over the stretch (100 = one core busy).
        rss_bytes: resident memory at the end (the peak, for a file).
        gpu: GPU memory (bytes) and utilization (percent) at the end, where there is a GPU.
    """

    wall_s: float
    seconds: dict[str, float]
    samples: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    gpu: dict[str, float] | None = None

    def fractions(self) -> dict[str, float]:
        """Share of the wall time per phase (zeros for an empty stretch)."""
        if self.wall_s <= 0:
            return dict.fromkeys(PROFILE_PHASES, 0.0)
        return {phase: self.seconds.get(phase, 0.0) / self.wall_s for phase in PROFILE_PHASES}

    def _rate(self, amount: float) -> float:
        return amount / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self._rate(self.samples)

    @property
    def sent_bytes_per_s(self) -> float:
        return self._rate(self.sent_bytes)

    @property
    def recv_bytes_per_s(self) -> float:
        return self._rate(self.recv_bytes)

    def verdict(self) -> Verdict:
        return diagnose(self.seconds, self.wall_s, sent_bytes=self.sent_bytes)


def nonnegative(seconds: Mapping[str, float]) -> dict[str, float]:
    """``seconds`` with negative entries zeroed and their sum taken from the largest phases.

    A stretch boundary that falls inside a blocking averaging call sees the call's all-reduce
    seconds moved out of ``matchmaking`` after the boundary (:meth:`PhaseClock.transfer`), which
    can leave the later stretch with negative matchmaking; the total stays exact.
    """
    result = {phase: float(seconds.get(phase, 0.0)) for phase in PROFILE_PHASES}
    deficit = -sum(s for s in result.values() if s < 0)
    if deficit <= 0:
        return result
    for phase in result:
        result[phase] = max(result[phase], 0.0)
    for phase in sorted(result, key=result.__getitem__, reverse=True):
        taken = min(deficit, result[phase])
        result[phase] -= taken
        deficit -= taken
        if deficit <= 0:
            break
    return result


def group_shares(seconds: Mapping[str, float], wall_s: float) -> dict[str, float]:
    """Shares of the wall time of the verdict's groups, plus ``other``."""
    if wall_s <= 0:
        return dict.fromkeys([*VERDICT_GROUPS, "other"], 0.0)
    shares = {
        group: sum(seconds.get(p, 0.0) for p in phases) / wall_s
        for group, phases in VERDICT_GROUPS.items()
    }
    shares["other"] = seconds.get("other", 0.0) / wall_s
    return shares


def diagnose(seconds: Mapping[str, float], wall_s: float, *, sent_bytes: float = 0) -> Verdict:
    """The bottleneck of a stretch (see the module docstring for the rules).

    Args:
        seconds: phase -> seconds in the stretch.
        wall_s: the stretch's wall time.
        sent_bytes: bytes sent in the stretch (for the all-reduce's rate).
    """
    if wall_s <= 0:
        return Verdict("balanced", "no time measured yet")
    # A busy host slows the work itself; the wait is spread over the phases it ran in and would
    # dilute the workload's own bottleneck, so the workload is judged on the rest.
    cpu_share = seconds.get("cpu_wait", 0.0) / wall_s
    busy_s = wall_s - seconds.get("cpu_wait", 0.0)
    if busy_s <= 0:
        return Verdict("balanced", _contention(cpu_share))
    seconds = {phase: spent_s for phase, spent_s in seconds.items() if phase != "cpu_wait"}
    share = {phase: seconds.get(phase, 0.0) / busy_s for phase in PROFILE_PHASES}
    groups = group_shares(seconds, busy_s)
    del groups["cpu"]
    top = max(LOST_GROUPS, key=groups.__getitem__)
    if groups[top] < LOST_FRACTION:
        top = "compute" if groups["compute"] >= COMPUTE_FRACTION else "balanced"
    if top == "balanced":
        parts = ", ".join(f"{g} {groups[g]:.0%}" for g in sorted(groups, key=groups.get)[::-1])
        text = f"no single bottleneck: {parts}"
    elif top == "data":
        if share["h2d"] > share["data"]:
            text = (
                f"data-loading bound: host-to-device copies {share['h2d']:.0%} of wall time; "
                "use pinned memory or keep the data on the device"
            )
        else:
            text = (
                f"data-loading bound: {share['data']:.0%} of wall time waiting for batches; "
                "try more loader workers (--num-workers) or a faster dataset"
            )
    elif top == "communication":
        text = _communication(share, seconds.get("allreduce", 0.0), sent_bytes)
    elif top == "swarm":
        text = f"waiting on the swarm: idle {share['idle']:.0%} of wall time"
    else:
        heaviest = max(VERDICT_GROUPS["compute"], key=share.__getitem__)
        text = (
            f"compute bound: forward/backward/optimizer {groups['compute']:.0%} of wall time "
            f"({heaviest} {share[heaviest]:.0%}); a faster device or a smaller model helps"
        )
    if cpu_share >= LOST_FRACTION:
        text += f" (of the time not waiting for a CPU); {_contention(cpu_share)}"
    elif cpu_share > 0:
        text += f" (shares of the time not waiting for a CPU; that wait was {cpu_share:.0%})"
    return Verdict(top, text)


def _contention(cpu_share: float) -> str:
    return (
        f"CPU contention: runnable but waiting for a CPU {cpu_share:.0%} of wall time; run fewer "
        "processes or threads (--torch-threads) than the machine has cores"
    )


def _communication(share: dict[str, float], allreduce_s: float, sent_bytes: float) -> str:
    phase = max(VERDICT_GROUPS["communication"], key=share.__getitem__)
    if phase == "allreduce":
        rate = f" at {8 * sent_bytes / allreduce_s / 1e6:.3g} Mbit/s" if allreduce_s > 0 else ""
        return (
            f"communication bound: all-reduce {share['allreduce']:.0%}{rate}; try --compression "
            "fp16 or uint8, or a larger --target-batch-size (fewer rounds)"
        )
    if phase == "matchmaking":
        return (
            f"communication bound: matchmaking {share['matchmaking']:.0%} (forming groups); "
            "a larger --target-batch-size makes rounds rarer"
        )
    return f"communication bound: downloading the swarm's state {share['state_sync']:.0%}"


SHORT_NAMES = {
    "data": "data",
    "h2d": "h2d",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "opt",
    "matchmaking": "match",
    "allreduce": "allred",
    "state_sync": "sync",
    "idle": "idle",
    "cpu_wait": "cpuw",
    "other": "other",
}


def mbit_per_s(bytes_per_s: float) -> str:
    return f"{8 * bytes_per_s / 1e6:.2f}"


def breakdown_table(columns: list[tuple[str, StretchSummary]], *, title: str) -> Table:
    """A rich table with one row per phase (seconds and % of wall time) and one column per
    stretch (e.g. the whole run and the last epoch), then rates and resources."""
    table = Table(title=title, title_justify="left")
    table.add_column("phase")
    for name, _ in columns:
        table.add_column(f"{name} s", justify="right")
        table.add_column("%", justify="right")
    fractions = [summary.fractions() for _, summary in columns]
    for phase in PROFILE_PHASES:
        cells = []
        for (_, summary), shares in zip(columns, fractions, strict=True):
            cells += [f"{summary.seconds.get(phase, 0.0):.2f}", f"{100 * shares[phase]:.1f}"]
        table.add_row(phase, *cells)
    table.add_section()
    rows = {
        "wall": lambda s: (f"{s.wall_s:.2f}", "100.0"),
        "samples/s": lambda s: (f"{s.samples_per_s:.1f}", ""),
        "sent Mbit/s": lambda s: (mbit_per_s(s.sent_bytes_per_s), ""),
        "recv Mbit/s": lambda s: (mbit_per_s(s.recv_bytes_per_s), ""),
        "CPU %": lambda s: (f"{s.cpu_percent:.0f}", ""),
        "RSS MiB": lambda s: (f"{s.rss_bytes / 2**20:.0f}", ""),
    }
    for label, cell in rows.items():
        table.add_row(label, *(text for _, summary in columns for text in cell(summary)))
    return table


def peers_table(rows: list[tuple[str, StretchSummary]], *, title: str) -> Table:
    """A rich table with one row per peer: % of wall time per phase, rates, bottleneck."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("peer", no_wrap=True)
    table.add_column("wall s", justify="right")
    for phase in PROFILE_PHASES:
        table.add_column(SHORT_NAMES[phase], justify="right")
    table.add_column("samples/s", justify="right")
    table.add_column("Mbit/s out", justify="right")
    table.add_column("in", justify="right")
    table.add_column("bound", no_wrap=True)
    for name, summary in rows:
        fractions = summary.fractions()
        table.add_row(
            name,
            f"{summary.wall_s:.0f}",
            *(f"{100 * fractions[phase]:.1f}" for phase in PROFILE_PHASES),
            f"{summary.samples_per_s:.0f}",
            mbit_per_s(summary.sent_bytes_per_s),
            mbit_per_s(summary.recv_bytes_per_s),
            summary.verdict().bottleneck,
        )
    return table
