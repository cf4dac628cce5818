"""Reading and checking metrics stream files (the JSON Lines of DESIGN.md, ``--metrics-file``).

:class:`MetricsLine` is the documented schema: every DESIGN.md field with its type and range,
extra fields allowed (a newer peer may add some). :func:`read_metrics` groups the valid lines of
many files by peer and counts the rest; :func:`summarize_lines` adds one peer's lines up into a
:class:`peer.profiling.summary.StretchSummary`. torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from peer.profiling.summary import StretchSummary, nonnegative
from peer.records.profile import PROFILE_PHASES

# Tolerance for phase seconds a float subtraction leaves just below zero.
_EPSILON_S = 1e-9
# Phases that streams written before they existed lack (read as 0 s).
_LATER_PHASES = frozenset({"cpu_wait"})


class NetBytes(BaseModel):
    model_config = ConfigDict(extra="allow")

    sent: int = Field(ge=0)
    recv: int = Field(ge=0)
    rtt_ms: float | None = Field(None, ge=0, description="median RTT to the peers asked")


class MetricsLine(BaseModel):
    """One line of the metrics stream, as DESIGN.md documents it (phases and bytes per line's
    interval; ``gpu`` only where there is a GPU)."""

    model_config = ConfigDict(extra="allow")

    t: float = Field(description="unix time of the line")
    peer: str = Field(min_length=1)
    run: str
    epoch: int = Field(ge=0)
    step: int = Field(ge=0)
    loss: float | None
    samples: int = Field(ge=0)
    samples_per_s: float = Field(ge=0)
    phases: dict[str, float]
    net: NetBytes
    cpu_percent: float = Field(ge=0)
    rss_bytes: int = Field(ge=0)
    gpu: dict[str, float] | None = None

    @field_validator("phases")
    @classmethod
    def _every_phase(cls, phases: dict[str, float]) -> dict[str, float]:
        if not set(PROFILE_PHASES) - _LATER_PHASES <= set(phases) <= set(PROFILE_PHASES):
            raise ValueError(f"phases must be exactly {', '.join(PROFILE_PHASES)}")
        if any(seconds < -_EPSILON_S for seconds in phases.values()):
            raise ValueError("phase seconds must be >= 0")
        return dict.fromkeys(_LATER_PHASES, 0.0) | phases


def validate_line(text: str) -> MetricsLine:
    """Parse and check one line.

    Raises:
        ValueError: not JSON, or not the documented fields (the message says which).
    """
    try:
        return MetricsLine.model_validate(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "line"
        raise ValueError(f"{where}: {error['msg']}") from None


@dataclasses.dataclass
class MetricsFiles:
    """What :func:`read_metrics` found.

    Attributes:
        peers: peer id -> its valid lines, in file order.
        num_bad_lines: path -> lines that were not valid (first error kept in ``errors``).
        errors: path -> the first invalid line's problem.
    """

    peers: dict[str, list[MetricsLine]] = dataclasses.field(default_factory=dict)
    num_bad_lines: dict[str, int] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)


def read_metrics(paths: Iterable[str | Path]) -> MetricsFiles:
    """The valid lines of every file, grouped by peer (a peer may span several files).

    Raises:
        OSError: a file cannot be read.
    """
    found = MetricsFiles()
    for path in paths:
        with Path(path).open(encoding="utf-8") as file:
            for number, text in enumerate(file, start=1):
                if not text.strip():
                    continue
                try:
                    line = validate_line(text)
                except ValueError as e:
                    found.num_bad_lines[str(path)] = found.num_bad_lines.get(str(path), 0) + 1
                    found.errors.setdefault(str(path), f"line {number}: {e}")
                    continue
                found.peers.setdefault(line.peer, []).append(line)
    return found


def summarize_lines(lines: Iterable[MetricsLine]) -> StretchSummary:
    """One peer's lines added up: seconds per phase, samples, bytes; CPU weighted by each
    line's wall time; the peak RSS."""
    seconds = dict.fromkeys(PROFILE_PHASES, 0.0)
    samples = sent = recv = rss = 0
    cpu_s = 0.0
    gpu = None
    for line in lines:
        for phase in PROFILE_PHASES:
            seconds[phase] += line.phases[phase]
        line_wall_s = sum(line.phases.values())
        cpu_s += line.cpu_percent / 100 * line_wall_s
        samples += line.samples
        sent += line.net.sent
        recv += line.net.recv
        rss = max(rss, line.rss_bytes)
        gpu = line.gpu if line.gpu is not None else gpu
    seconds = nonnegative(seconds)
    wall_s = sum(seconds.values())
    return StretchSummary(
        wall_s=wall_s,
        seconds=seconds,
        samples=samples,
        sent_bytes=sent,
        recv_bytes=recv,
        cpu_percent=100 * cpu_s / wall_s if wall_s > 0 else 0.0,
        rss_bytes=rss,
        gpu=gpu,
    )


def aggregate(summaries: Iterable[StretchSummary]) -> StretchSummary:
    """Many peers' summaries as the swarm's: phase fractions over all peer-seconds (each peer
    weighs by its wall time), over the peers' mean wall time, so that samples/s, bytes/s and
    CPU % are the swarm's totals (sums over peers); RSS is summed too."""
    summaries = list(summaries)
    if not summaries:
        return StretchSummary(wall_s=0.0, seconds=dict.fromkeys(PROFILE_PHASES, 0.0))
    num = len(summaries)
    seconds = {p: sum(s.seconds.get(p, 0.0) for s in summaries) / num for p in PROFILE_PHASES}
    wall_s = sum(s.wall_s for s in summaries) / num
    cpu_s = sum(s.cpu_percent / 100 * s.wall_s for s in summaries)
    return StretchSummary(
        wall_s=wall_s,
        seconds=seconds,
        samples=sum(s.samples for s in summaries),
        sent_bytes=sum(s.sent_bytes for s in summaries),
        recv_bytes=sum(s.recv_bytes for s in summaries),
        cpu_percent=100 * cpu_s / wall_s if wall_s > 0 else 0.0,
        rss_bytes=sum(s.rss_bytes for s in summaries),
    )
