"""Settings of the monitor (``peer monitor`` and ``peer join --dashboard``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dht.errors import ConfigError

# The most the live view redraws per second (terminal manners: no flicker, little CPU).
MAX_REFRESH_PER_S = 4.0


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """What the monitor reads and how it judges what it sees.

    Attributes:
        run_id: the run to watch (the DHT key prefix).
        interval_s: seconds between two reads of the DHT (and two plain lines without a TTY).
        read_timeout_s: bound on one read of the records, in seconds.
        refresh_per_s: redraws of the live view per second (at most 4).
        target_batch_size: samples per swarm epoch; None reads it from the peers' round records.
        stale_after_s: a peer whose progress record is older than this, in seconds, is shown as
            out of date.
        straggler_ratio: a peer training slower than this share of the swarm's median rate is a
            straggler.
        behind_alert_s: a peer behind the swarm's epoch for this long, in seconds, raises an
            alert (two epochs behind raises one at once).
        profile_max_age_s: profile records older than this, in seconds, are ignored.
        max_extrapolation_s: how far past its timestamp a progress record is extrapolated, in s.
        alert_keep_s: events (peer left, round failed) stay on screen this long, in seconds.
        max_alerts: events kept at most.
        max_rounds: epochs of rounds kept in a view.
        loss_history_points: points of the loss curve kept.
    """

    run_id: str = "vp-run"
    interval_s: float = 1.0
    read_timeout_s: float = 10.0
    refresh_per_s: float = MAX_REFRESH_PER_S
    target_batch_size: int | None = None
    stale_after_s: float = 10.0
    straggler_ratio: float = 0.5
    behind_alert_s: float = 10.0
    profile_max_age_s: float = 120.0
    max_extrapolation_s: float = 10.0
    alert_keep_s: float = 120.0
    max_alerts: int = 50
    max_rounds: int = 10
    loss_history_points: int = 600

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ConfigError("run_id must not be empty")
        for name in (
            "interval_s",
            "read_timeout_s",
            "refresh_per_s",
            "stale_after_s",
            "behind_alert_s",
            "profile_max_age_s",
            "max_extrapolation_s",
            "alert_keep_s",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if self.refresh_per_s > MAX_REFRESH_PER_S:
            raise ConfigError(f"refresh_per_s must be at most {MAX_REFRESH_PER_S}")
        if not 0 <= self.straggler_ratio < 1:
            raise ConfigError(f"straggler_ratio must be in [0, 1), got {self.straggler_ratio}")
        if self.target_batch_size is not None and self.target_batch_size < 1:
            raise ConfigError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        for name in ("max_alerts", "max_rounds", "loss_history_points"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
