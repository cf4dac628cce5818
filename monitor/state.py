"""The swarm as the dashboard shows it: an immutable :class:`SwarmView` built from DHT records.

:class:`ViewBuilder` turns one read of the run's records (progress, profile and round records,
already parsed) into a view, and keeps what needs memory across reads: the loss over time, which
peers were seen before (to say who left) and which rounds were already reported (alerts fire
once). Everything here is pure and clock-injected, so rendering tests build views by hand.
The view's dataclasses live in :mod:`monitor.view` and are re-exported here.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dht.identity import short_id
from monitor.config import MonitorConfig
from monitor.view import Alert, PeerView, RoundRow, SwarmVerdict, SwarmView
from peer.records.profile import PHASE_GROUPS, ProfileRecord
from peer.records.progress import PeerProgress
from peer.records.rounds import RoundEntry, RoundLogRecord
from peer.records.state import StateAnnouncement, replica_outliers

# Worst first: the status a round row shows when its peers disagree.
_STATUS_RANK = {"failed": 0, "partial": 1, "alone": 2, "ok": 3}


# ---- pure pieces -------------------------------------------------------------------------------


def swarm_epoch(epochs: Sequence[int]) -> int:
    """The newest epoch that at least two peers (or the only one) have reached."""
    quorum = min(2, len(epochs))
    for candidate in sorted(set(epochs), reverse=True):
        if sum(epoch >= candidate for epoch in epochs) >= quorum:
            return candidate
    return 0


def merge_rounds(
    logs: Iterable[RoundLogRecord], *, num_swarm_peers: int, max_rows: int
) -> tuple[RoundRow, ...]:
    """The last ``max_rows`` epochs' rounds, newest first, merged over the peers' records."""
    by_epoch: dict[int, list[RoundEntry]] = collections.defaultdict(list)
    for log in logs:
        for entry in log.rounds:
            by_epoch[entry.epoch].append(entry)
    rows = []
    for epoch in sorted(by_epoch, reverse=True)[:max_rows]:
        entries = by_epoch[epoch]
        # groups that averaged; peers that stepped alone show in ``num_local`` instead
        groups = {
            e.group_id or f"unnamed-{i}": e.group_size
            for i, e in enumerate(entries)
            if e.status in ("ok", "partial")
        }
        averaged = [e.averaged_fraction for e in entries if e.status in ("ok", "partial")]
        losses = [e.loss for e in entries if e.loss is not None]
        rows.append(
            RoundRow(
                epoch=epoch,
                end_time=max(e.end_time for e in entries),
                num_reporting=len(entries),
                group_sizes=tuple(sorted(groups.values(), reverse=True)),
                num_swarm_peers=num_swarm_peers,
                duration_s=max(e.duration_s for e in entries),
                sent_bytes=sum(e.sent_bytes for e in entries),
                num_dropped=max(e.num_dropped for e in entries),
                averaged_fraction=statistics.fmean(averaged) if averaged else 0.0,
                num_local=sum(e.local_fallback for e in entries),
                num_failed=sum(e.status == "failed" for e in entries),
                num_partial=sum(e.status == "partial" for e in entries),
                status=min((e.status for e in entries), key=lambda s: _STATUS_RANK.get(s, 0)),
                loss=statistics.fmean(losses) if losses else None,
            )
        )
    return tuple(rows)


def swarm_verdict(profiles: Iterable[ProfileRecord]) -> SwarmVerdict | None:
    """The most common bottleneck among ``profiles`` and the mean group shares, or None."""
    profiles = list(profiles)
    if not profiles:
        return None
    counts = collections.Counter(p.bottleneck for p in profiles)
    groups = [p.group_fractions() for p in profiles]
    fractions = {g: statistics.fmean(f[g] for f in groups) for g in PHASE_GROUPS}
    bottleneck, num_agree = max(counts.items(), key=lambda item: (item[1], item[0] != "balanced"))
    example = next((p.verdict for p in profiles if p.bottleneck == bottleneck and p.verdict), "")
    return SwarmVerdict(bottleneck, num_agree, len(profiles), fractions, example)


def current_loss(peer: PeerView) -> tuple[float, float] | None:
    """(DHT time, loss) of the peer's freshest loss report, or None."""
    candidates = []
    if peer.profile is not None and peer.profile.loss is not None:
        candidates.append((peer.profile.time, peer.profile.loss))
    if peer.rounds is not None:
        candidates.extend((e.end_time, e.loss) for e in peer.rounds.rounds if e.loss is not None)
    return max(candidates) if candidates else None


# ---- the stateful builder ----------------------------------------------------------------------


@dataclass
class _Memory:
    loss: collections.deque = field(default_factory=collections.deque)
    known: dict[str, PeerView] = field(default_factory=dict)
    reported_rounds: set[tuple[str, int]] = field(default_factory=set)
    events: collections.deque = field(default_factory=collections.deque)
    behind_since: dict[str, float] = field(default_factory=dict)
    first: bool = True


class ViewBuilder:
    """Builds successive :class:`SwarmView` frames and remembers what alerts need.

    Args:
        config: the monitor's settings (thresholds, history lengths).
        local_peer_id: the peer the dashboard runs in, highlighted and given its own panel.
    """

    def __init__(self, config: MonitorConfig, *, local_peer_id: str | None = None):
        self.config = config
        self.local_peer_id = local_peer_id
        self._memory = _Memory(loss=collections.deque(maxlen=config.loss_history_points))

    def build(
        self,
        *,
        progress: Sequence[PeerProgress],
        profiles: Sequence[ProfileRecord],
        rounds: Sequence[RoundLogRecord],
        now: float,
        error: str | None = None,
        states: Sequence[StateAnnouncement] = (),
    ) -> SwarmView:
        """The frame for one read of the records at DHT time ``now`` (``states``: the peers'
        state announcements, whose digests mark replicas that differ from their group's)."""
        cfg = self.config
        differ = replica_outliers(states)
        profile_of = {p.peer_id: p for p in profiles if now - p.time <= cfg.profile_max_age_s}
        rounds_of = {r.peer_id: r for r in rounds}
        epoch = swarm_epoch([p.epoch for p in progress])
        rates = [p.samples_per_s for p in progress if p.samples_per_s > 0]
        median_rate = statistics.median(rates) if len(rates) >= 2 else 0.0
        peers = []
        for record in sorted(progress, key=lambda p: p.peer_id):
            age_s = max(0.0, now - record.time)
            peers.append(
                PeerView(
                    peer_id=record.peer_id,
                    address=record.address,
                    epoch=record.epoch,
                    samples=record.samples,
                    samples_per_s=record.samples_per_s,
                    age_s=age_s,
                    profile=profile_of.get(record.peer_id),
                    rounds=rounds_of.get(record.peer_id),
                    behind=record.epoch < epoch,
                    straggler=record.samples_per_s < cfg.straggler_ratio * median_rate,
                    stale=age_s > cfg.stale_after_s,
                    local=record.peer_id == self.local_peer_id,
                    replica_differs=record.peer_id in differ,
                )
            )
        accumulated, target = self._accumulated(peers, epoch, now), self._target(rounds)
        if target is not None:  # extrapolated past the target: the round is due, not "120%"
            accumulated = min(accumulated, float(target))
        rate = sum(p.samples_per_s for p in peers)
        missing = max(0.0, (target or 0) - accumulated)
        eta_s = 0.0 if not missing else (missing / rate if rate > 0 else math.inf)
        alerts = self._alerts(peers, rounds, epoch, now)
        self._track_loss(peers, now)
        return SwarmView(
            run_id=cfg.run_id,
            time=now,
            epoch=epoch,
            target_batch_size=target,
            samples_accumulated=int(accumulated),
            samples_per_s=rate,
            eta_s=eta_s if target is not None else math.inf,
            peers=tuple(peers),
            rounds=merge_rounds(rounds, num_swarm_peers=len(peers), max_rows=cfg.max_rounds),
            loss_history=tuple(self._memory.loss),
            verdict=swarm_verdict(p.profile for p in peers if p.profile is not None),
            alerts=alerts,
            local_peer_id=self.local_peer_id,
            error=error,
            num_rounds=max((r.num_rounds for r in rounds), default=0),
            num_failed_rounds=sum(r.num_failed_rounds for r in rounds),
        )

    def _target(self, rounds: Sequence[RoundLogRecord]) -> int | None:
        if self.config.target_batch_size is not None:
            return self.config.target_batch_size
        counts = collections.Counter(r.target_batch_size for r in rounds)
        return counts.most_common(1)[0][0] if counts else None

    def _accumulated(self, peers: Sequence[PeerView], epoch: int, now: float) -> float:
        total = 0.0
        for peer in peers:
            if peer.epoch == epoch:
                extrapolated_s = min(peer.age_s, self.config.max_extrapolation_s)
                total += peer.samples + peer.samples_per_s * extrapolated_s
        return total

    def _track_loss(self, peers: Sequence[PeerView], now: float) -> None:
        history = self._memory.loss
        if self._memory.first:  # seed the curve with the rounds the peers remember
            points: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
            for peer in peers:
                for entry in peer.rounds.rounds if peer.rounds else ():
                    if entry.loss is not None:
                        points[entry.epoch].append((entry.end_time, entry.loss))
            seeded = []
            for epoch in sorted(points):
                times, losses = zip(*points[epoch], strict=True)
                seeded.append((min(max(times), now), statistics.fmean(losses)))
            history.extend(sorted(seeded))
            self._memory.first = False
        current = [loss for peer in peers if (loss := current_loss(peer)) is not None]
        if current:
            value = statistics.fmean(loss for _, loss in current)
            if not history or history[-1][0] < now:
                history.append((now, value))

    def _alerts(
        self,
        peers: Sequence[PeerView],
        rounds: Sequence[RoundLogRecord],
        epoch: int,
        now: float,
    ) -> tuple[Alert, ...]:
        cfg, memory = self.config, self._memory
        events = memory.events
        current = {p.peer_id: p for p in peers}
        if not memory.first:
            for peer_id, old in memory.known.items():
                if peer_id not in current:
                    events.append(
                        Alert("warning", f"peer {short_id(peer_id)} left (epoch {old.epoch})", now)
                    )
            for peer_id in current.keys() - memory.known.keys():
                events.append(Alert("info", f"peer {short_id(peer_id)} joined", now))
        memory.known = current
        for log in rounds:
            for entry in log.rounds:
                key = (log.peer_id, entry.epoch)
                if key in memory.reported_rounds or now - entry.end_time > cfg.alert_keep_s:
                    continue
                memory.reported_rounds.add(key)
                alert = _round_alert(log.peer_id, entry)
                if alert is not None:
                    events.append(alert)
        while events and now - events[0].time > cfg.alert_keep_s:
            events.popleft()
        while len(events) > cfg.max_alerts:
            events.popleft()
        conditions = []
        for peer in peers:
            since = memory.behind_since.setdefault(peer.peer_id, now) if peer.behind else None
            if not peer.behind:
                memory.behind_since.pop(peer.peer_id, None)
            elif peer.epoch <= epoch - 2 or now - since >= cfg.behind_alert_s:
                text = f"peer {peer.short_id} behind: epoch {peer.epoch}, swarm at {epoch}"
                conditions.append(Alert("warning", text, now))
            if peer.stale:
                text = f"peer {peer.short_id} silent for {peer.age_s:.0f} s"
                conditions.append(Alert("warning", text, now))
            if peer.replica_differs:
                text = f"peer {peer.short_id}: its replica differs from its group's"
                conditions.append(Alert("error", text, now))
        return (*conditions, *reversed(events))


def _round_alert(peer_id: str, entry: RoundEntry) -> Alert | None:
    who = short_id(peer_id)
    if entry.status == "failed":
        reason = f": {entry.reason}" if entry.reason else ""
        return Alert("error", f"epoch {entry.epoch}: round failed on {who}{reason}", entry.end_time)
    if entry.status == "partial":
        text = (
            f"epoch {entry.epoch}: partial round on {who} "
            f"({entry.averaged_fraction:.0%} averaged, {entry.num_dropped} dropped)"
        )
        return Alert("warning", text, entry.end_time)
    return None


__all__ = [
    "Alert",
    "PeerView",
    "RoundRow",
    "SwarmVerdict",
    "SwarmView",
    "ViewBuilder",
    "current_loss",
    "merge_rounds",
    "swarm_epoch",
    "swarm_verdict",
]
