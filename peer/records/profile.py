"""The per-peer profile summary published on the DHT (``{run_id}/profile``), and its parser.

Each training peer stores one signed, expiring record under its own subkey
(:func:`dht.kademlia.validation.owner_subkey`) every few seconds; the dashboard and other peers read
the whole dictionary to show the swarm's breakdown. Rates and fractions cover the publisher's
rolling window (``window_s`` seconds). This module is torch-free so that ``peer monitor`` stays
light.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated

from pydantic import Field

from peer.records.schema import (
    Count,
    Fraction,
    Loss,
    Rate,
    Seconds,
    WireModel,
    owner_of,
    parse_value,
    text,
)

PROFILE_KEY_SUFFIX = "profile"
# Records a profile bucket holds, about (a few hundred bytes each: some 10 KB a key).
PROFILE_RECORDS_PER_BUCKET = 32
# The phases a peer's time is attributed to (:mod:`peer.profiling.phases` keeps the clock of them;
# the metrics stream and the profile record carry them in this order). ``cpu_wait`` is time the
# peer was runnable but waited for a CPU (:mod:`peer.profiling.cpu_wait`); older peers lack it.
PROFILE_PHASES: tuple[str, ...] = (
    "data",
    "h2d",
    "forward",
    "backward",
    "optimizer",
    "matchmaking",
    "allreduce",
    "state_sync",
    "idle",
    "cpu_wait",
    "other",
)
# The four groups a dashboard bar shows, and which phases make each of them.
PHASE_GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data", "h2d"),
    "compute": ("forward", "backward", "optimizer"),
    "comm": ("matchmaking", "allreduce", "state_sync"),
    "idle": ("idle", "cpu_wait", "other"),
}


def profile_key(run_id: str) -> str:
    """The prefix of a run's profile keys (records live in its buckets:
    :mod:`peer.records.buckets`)."""
    return f"{run_id}/{PROFILE_KEY_SUFFIX}"


@dataclass(frozen=True, kw_only=True)
class ProfileRecord:
    """One peer's profile summary over its last window.

    Attributes:
        peer_id: the publisher (from the signed subkey, never from the value).
        time: the publisher's DHT time (unix seconds) when it published.
        epoch: the publisher's epoch.
        window_s: seconds the fractions and rates cover.
        fractions: phase of :data:`PROFILE_PHASES` -> share of ``window_s`` (sums to about 1).
        samples_per_s: local samples per second over the window.
        sent_bytes_per_s: bytes sent per second over the window (all peers).
        recv_bytes_per_s: bytes received per second over the window.
        cpu_percent: the process's CPU use (100 = one core busy).
        rss_bytes: the process's resident memory.
        device: where it trains (``cpu``, ``cuda:0``, ...).
        loss: the last training loss, or None.
        bottleneck: ``data``, ``compute``, ``communication``, ``swarm`` or ``balanced``
            (free text on the wire: peers before 2026-11-26 may say ``cpu``).
        verdict: one human sentence with the evidence (e.g. "data-loading bound: 46% ...").
        backend: ``native`` or ``hivemind``.
    """

    peer_id: str
    time: float
    epoch: int
    window_s: float
    fractions: dict[str, float] = field(default_factory=dict)
    samples_per_s: float = 0.0
    sent_bytes_per_s: float = 0.0
    recv_bytes_per_s: float = 0.0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    device: str = "cpu"
    loss: float | None = None
    bottleneck: str = "balanced"
    verdict: str = ""
    backend: str = "native"

    def to_wire(self) -> dict:
        """The record's value as stored on the DHT (msgpack-able; no peer id: the subkey is)."""
        value = asdict(self)
        del value["peer_id"]
        return value

    def group_fractions(self) -> dict[str, float]:
        """Shares of the four dashboard groups of :data:`PHASE_GROUPS`."""
        return {
            group: sum(self.fractions.get(phase, 0.0) for phase in phases)
            for group, phases in PHASE_GROUPS.items()
        }


class ProfileWire(WireModel):
    """The profile record's value as it travels (see :class:`ProfileRecord`)."""

    time: Seconds
    epoch: Count
    window_s: Seconds
    fractions: dict[text(32), Fraction] = Field(default_factory=dict, max_length=64)
    samples_per_s: Rate = 0.0
    sent_bytes_per_s: Rate = 0.0
    recv_bytes_per_s: Rate = 0.0
    cpu_percent: Annotated[float, Field(ge=0.0, le=1e6)] = 0.0
    rss_bytes: Count = 0
    device: text(128) = "cpu"
    loss: Loss = None
    bottleneck: text(128) = "balanced"
    verdict: text(800) = ""
    backend: text(64) = "native"


def parse_profile(subkey: object, value: object) -> ProfileRecord | None:
    """A peer's profile record from the DHT, or None (counted) if it does not fit the schema.

    Fractions of unknown phases are ignored and unknown fields too, so newer publishers stay
    readable; long strings are cut to what the dashboard shows.
    """
    peer_id = owner_of(subkey)
    wire = parse_value(ProfileWire, "profile", peer_id, value)
    if wire is None or peer_id is None:
        return None
    return ProfileRecord(
        peer_id=peer_id,
        time=wire.time,
        epoch=wire.epoch,
        window_s=wire.window_s,
        fractions={p: wire.fractions[p] for p in PROFILE_PHASES if p in wire.fractions},
        samples_per_s=wire.samples_per_s,
        sent_bytes_per_s=wire.sent_bytes_per_s,
        recv_bytes_per_s=wire.recv_bytes_per_s,
        cpu_percent=wire.cpu_percent,
        rss_bytes=wire.rss_bytes,
        device=wire.device[:32],
        loss=wire.loss,
        bottleneck=wire.bottleneck[:32],
        verdict=wire.verdict[:200],
        backend=wire.backend[:16],
    )
