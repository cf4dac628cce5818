"""The per-peer profile summary published on the DHT (``{run_id}/profile``), and its parser.

Each training peer stores one signed, expiring record under its own subkey
(:func:`dht.validation.owner_subkey`) every few seconds; the dashboard and other peers read the
whole dictionary to show the swarm's breakdown. Rates and fractions cover the publisher's rolling
window (``window_s`` seconds). This module is torch-free so that ``peer monitor`` stays light.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dht.validation import subkey_owner

PROFILE_KEY_SUFFIX = "profile"
# The phases a peer's time is attributed to (:mod:`peer.profiling.phases` keeps the clock of them;
# the metrics stream and the profile record carry them in this order).
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
    "other",
)
# The four groups a dashboard bar shows, and which phases make each of them.
PHASE_GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data", "h2d"),
    "compute": ("forward", "backward", "optimizer"),
    "comm": ("matchmaking", "allreduce", "state_sync"),
    "idle": ("idle", "other"),
}


def profile_key(run_id: str) -> str:
    """The DHT key of a run's profile records."""
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
        bottleneck: ``data``, ``compute``, ``communication``, ``swarm`` or ``balanced``.
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


def _finite(value: object, *, low: float = 0.0, high: float = math.inf) -> float:
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError("not finite")
    return min(max(number, low), high)


def parse_profile(subkey: object, value: object) -> ProfileRecord | None:
    """A peer's profile record from the DHT, or None if it is malformed.

    Numbers are clamped to plausible ranges (fractions to [0, 1]); unknown fields are ignored,
    so newer publishers stay readable.
    """
    peer_id = subkey_owner(subkey) if isinstance(subkey, str) else None
    if peer_id is None or not isinstance(value, dict):
        return None
    try:
        raw_fractions = value.get("fractions", {})
        if not isinstance(raw_fractions, dict):
            return None
        fractions = {
            phase: _finite(raw_fractions[phase], high=1.0)
            for phase in PROFILE_PHASES
            if phase in raw_fractions
        }
        loss = value.get("loss")
        return ProfileRecord(
            peer_id=peer_id,
            time=_finite(value["time"]),
            epoch=int(_finite(value["epoch"], high=2**62)),
            window_s=_finite(value["window_s"]),
            fractions=fractions,
            samples_per_s=_finite(value.get("samples_per_s", 0.0)),
            sent_bytes_per_s=_finite(value.get("sent_bytes_per_s", 0.0)),
            recv_bytes_per_s=_finite(value.get("recv_bytes_per_s", 0.0)),
            cpu_percent=_finite(value.get("cpu_percent", 0.0)),
            rss_bytes=int(_finite(value.get("rss_bytes", 0), high=2**62)),
            device=str(value.get("device", "cpu"))[:32],
            loss=None if loss is None else float(loss),
            bottleneck=str(value.get("bottleneck", "balanced"))[:32],
            verdict=str(value.get("verdict", ""))[:200],
            backend=str(value.get("backend", "native"))[:16],
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
