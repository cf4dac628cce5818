"""A synthetic swarm: progress, profile and round records of several peers, as a reader gets
them, so rendering tests know every number they should see."""

from __future__ import annotations

from monitor.config import MonitorConfig
from monitor.state import SwarmView, ViewBuilder
from peer.records.profile import ProfileRecord
from peer.records.progress import PeerProgress
from peer.records.rounds import RoundEntry, RoundLogRecord, group_name

NOW = 1_700_000_000.0
TARGET = 4096
# peer id -> (address, epoch, samples, samples/s, age s, fractions of data/compute/comm/idle)
PEERS = {
    "a1" * 32: ("http://127.0.0.1:40001", 7, 400, 900.0, 0.5, (0.1, 0.6, 0.2, 0.1)),
    "b2" * 32: ("http://127.0.0.1:40002", 7, 300, 800.0, 1.0, (0.05, 0.7, 0.15, 0.1)),
    "c3" * 32: (None, 7, 200, 250.0, 0.2, (0.5, 0.3, 0.1, 0.1)),
    "d4" * 32: ("http://127.0.0.1:40004", 5, 100, 700.0, 25.0, (0.0, 0.5, 0.5, 0.0)),
}
GROUPS = {"data": ("data",), "compute": ("forward",), "comm": ("allreduce",), "idle": ("idle",)}


def progress(now: float = NOW, peers=PEERS) -> list[PeerProgress]:
    return [
        PeerProgress(peer_id, epoch, samples, rate, now - age, address, address is None)
        for peer_id, (address, epoch, samples, rate, age, _) in peers.items()
    ]


def profiles(now: float = NOW, peers=PEERS) -> list[ProfileRecord]:
    records = []
    for index, (peer_id, (_, epoch, _, rate, _, shares)) in enumerate(peers.items()):
        fractions = {
            phases[0]: share for phases, share in zip(GROUPS.values(), shares, strict=True)
        }
        bottleneck = "data" if shares[0] >= 0.4 else "compute"
        records.append(
            ProfileRecord(
                peer_id=peer_id,
                time=now - 1,
                epoch=epoch,
                window_s=30.0,
                fractions=fractions,
                samples_per_s=rate,
                sent_bytes_per_s=1000.0 * (index + 1),
                recv_bytes_per_s=1000.0 * (index + 1),
                cpu_percent=95.0,
                rss_bytes=300 * 2**20,
                device="cpu",
                loss=0.5 + 0.1 * index,
                bottleneck=bottleneck,
                verdict=f"{bottleneck} bound: {max(shares):.0%} of wall time",
            )
        )
    return records


def round_logs(now: float = NOW, num_epochs: int = 7) -> list[RoundLogRecord]:
    """Peers a1, b2, c3 averaged together every epoch; epoch 6 failed on c3 (it stepped alone)
    and was partial for the others (one peer dropped, 2/3 averaged)."""
    members = ["a1" * 32, "b2" * 32, "c3" * 32]
    logs = []
    for peer_id in members:
        entries = []
        for epoch in range(num_epochs):
            end = now - (num_epochs - epoch) * 3.0
            failed, partial = epoch == 6 and peer_id == members[2], epoch == 6
            entries.append(
                RoundEntry(
                    epoch=epoch,
                    end_time=end,
                    status="failed" if failed else "partial" if partial else "ok",
                    group_size=1 if failed else 2 if partial else 3,
                    group_id="" if failed else group_name(members[:2] if partial else members),
                    duration_s=0.5 + 0.1 * epoch,
                    sent_bytes=1_000_000,
                    recv_bytes=1_000_000,
                    num_dropped=1 if partial and not failed else 0,
                    averaged_fraction=0.0 if failed else 2 / 3 if partial else 1.0,
                    loss=2.3 - 0.25 * epoch,
                    reason="no group formed" if failed else "",
                )
            )
        logs.append(
            RoundLogRecord(
                peer_id=peer_id,
                time=now - 1,
                epoch=num_epochs,
                target_batch_size=TARGET,
                num_rounds=num_epochs,
                num_failed_rounds=1 if peer_id == members[2] else 0,
                num_local_steps=1 if peer_id == members[2] else 0,
                rounds=tuple(entries[-10:]),
            )
        )
    return logs


def sample_view(*, local_peer_id: str | None = None, previous_peers=None) -> SwarmView:
    """A view of the sample swarm; with ``previous_peers``, an earlier read saw those peers
    (so one that is gone now raises "left")."""
    builder = ViewBuilder(MonitorConfig(run_id="demo"), local_peer_id=local_peer_id)
    if previous_peers is not None:
        builder.build(
            progress=progress(NOW - 2, previous_peers),
            profiles=[],
            rounds=round_logs(NOW - 2, 6),
            now=NOW - 2,
        )
    return builder.build(progress=progress(), profiles=profiles(), rounds=round_logs(), now=NOW)
