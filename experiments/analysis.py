"""Numbers from a configuration's metrics stream files (and its status file), torch-free.

The swarm's loss at a moment is the mean over peers of each peer's recent loss (the mean of its
last :data:`LOSS_WINDOW` metrics lines); the curve has one point per metrics line of any peer, at
the line's time since the configuration's streams began (the earliest line's time minus its
interval) and the samples all peers had processed by then. The report and the live target-loss
rule both use these definitions.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from peer.profiling.metrics_reader import MetricsLine, aggregate, read_metrics, summarize_lines
from peer.profiling.summary import StretchSummary

LOSS_WINDOW = 3
STATUS_FILE = "status.json"
# Where each process of a configuration ran (the ray launcher): a list of {name, node_id,
# address, ...}.
PLACEMENT_FILE = "placement.json"


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    t_s: float
    samples: int
    loss: float


def loss_curve(peers: dict[str, list[MetricsLine]]) -> list[CurvePoint]:
    """The swarm's loss curve (see the module docstring)."""
    lines = sorted((line for lines in peers.values() for line in lines), key=lambda x: x.t)
    if not lines:
        return []
    start_t = min(ls[0].t - sum(ls[0].phases.values()) for ls in peers.values() if ls)
    recent: dict[str, collections.deque[float]] = {}
    samples, curve = 0, []
    for line in lines:
        samples += line.samples
        if line.loss is not None:
            recent.setdefault(line.peer, collections.deque(maxlen=LOSS_WINDOW)).append(line.loss)
        if recent:
            loss = sum(sum(d) / len(d) for d in recent.values()) / len(recent)
            curve.append(CurvePoint(line.t - start_t, samples, loss))
    return curve


def time_to_target(curve: list[CurvePoint], target: float | None) -> float | None:
    """Seconds until the swarm's loss first reached ``target`` (None: never, or no target)."""
    if target is None:
        return None
    return next((point.t_s for point in curve if point.loss <= target), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigResult:
    """What one configuration achieved, from its files.

    Attributes:
        name, baseline, seed, grid: from its ``config.json``.
        status: ``done`` or ``failed`` (``reason`` says why).
        num_peers: peers that wrote metrics.
        curve: the swarm's loss curve.
        swarm: the peers' phase summaries aggregated
        (:func:`peer.profiling.metrics_reader.aggregate`).
        rounds: the highest epoch any peer reached.
        time_to_target_s: see :func:`time_to_target`.
        load_average: the machine's 1-minute load average at its start and end.
        rtt_ms: the median of the peers' measured RTTs (``net.rtt_ms`` of every line that has
            one); None without any.
        sent_mbit_per_s: bits a peer sent per second of its wall time, Mbit/s, averaged over
            peers; None without peers.
    """

    name: str
    baseline: bool
    seed: int
    grid: dict[str, Any]
    status: str
    reason: str
    num_peers: int
    curve: list[CurvePoint]
    swarm: StretchSummary
    rounds: int
    time_to_target_s: float | None
    num_bad_lines: int
    load_average: list[float] = dataclasses.field(default_factory=list)
    rtt_ms: float | None = None
    sent_mbit_per_s: float | None = None

    @property
    def final_loss(self) -> float | None:
        return self.curve[-1].loss if self.curve else None

    @property
    def sent_bytes_per_round(self) -> float | None:
        """Bytes one peer sent per round, averaged over peers (None without rounds)."""
        if self.rounds == 0 or self.num_peers == 0 or self.baseline:
            return None
        return self.swarm.sent_bytes / self.num_peers / self.rounds


def metrics_files(config_dir: Path) -> list[Path]:
    return sorted(config_dir.glob("*.jsonl"))


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def load_result(config_dir: Path, target_loss: float | None) -> ConfigResult:
    """Read one configuration's directory."""
    described = read_json(config_dir / "config.json")
    status = read_json(config_dir / STATUS_FILE)
    found = read_metrics(metrics_files(config_dir))
    summaries = [summarize_lines(lines) for lines in found.peers.values()]
    curve = loss_curve(found.peers)
    return ConfigResult(
        name=described.get("name", config_dir.name),
        baseline=bool(described.get("baseline", False)),
        seed=int(described.get("seed", 0)),
        grid=described.get("grid", {}),
        status=status.get("status", "unfinished"),
        reason=status.get("reason", ""),
        num_peers=len(found.peers),
        curve=curve,
        swarm=aggregate(summaries),
        rounds=max((lines[-1].epoch for lines in found.peers.values() if lines), default=0),
        time_to_target_s=time_to_target(curve, target_loss),
        num_bad_lines=sum(found.num_bad_lines.values()),
        load_average=[float(v) for v in status.get("load_average", [])],
        rtt_ms=_median_rtt_ms(found.peers),
        sent_mbit_per_s=_sent_mbit_per_s(summaries),
    )


def _median_rtt_ms(peers: dict[str, list[MetricsLine]]) -> float | None:
    rtts = [line.net.rtt_ms for lines in peers.values() for line in lines]
    rtts = [rtt for rtt in rtts if rtt is not None]
    return statistics.median(rtts) if rtts else None


def _sent_mbit_per_s(summaries: list[StretchSummary]) -> float | None:
    rates = [s.sent_bytes * 8 / s.wall_s / 1e6 for s in summaries if s.wall_s > 0]
    return sum(rates) / len(rates) if rates else None
