"""A synthetic swarm: progress, profile and round records of several peers, as a reader gets
them, so rendering tests know every number they should see."""

from __future__ import annotations

from monitor.config import MonitorConfig
from monitor.state import SwarmView, ViewBuilder
from peer.records.profile import ProfileRecord
from peer.records.progress import PeerProgress
from peer.records.rounds import RoundEntry, RoundLogRecord, group_name
from peer.records.state import EpochDigest, StateAnnouncement

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


# ---- a big swarm (the dashboard's overview) ----------------------------------------------------

CROWD_EPOCH = 10
CROWD_GROUP_SIZE = 4
CROWD_ROUND_EPOCHS = (7, 8, 9)
GOOD_DIGEST = "ab" * 32


def crowd_index(peer_id: str) -> int:
    return int(peer_id[:4], 16)


def crowd_peers(num_peers: int = 200) -> dict:
    """``num_peers`` peers (ids ``0000...`` up): every 17th from 5 on is 1-3 epochs behind,
    every 50th from 7 on is out of date, rates spread over 100-499 samples/s."""
    peers = {}
    for i in range(num_peers):
        lag = 1 + i % 3 if i % 17 == 5 else 0
        address = f"http://10.0.{i // 250}.{i % 250 + 1}:4000"
        age_s = 30.0 if i % 50 == 7 else 1.0
        rate = 100.0 + (i * 37) % 400
        peers[f"{i:04x}" * 16] = (
            address,
            CROWD_EPOCH - lag,
            10 * i,
            rate,
            age_s,
            (0.1, 0.6, 0.2, 0.1),
        )
    return peers


def crowd_differs(peers: dict) -> set[str]:
    """Peers at the swarm's epoch whose replica differs (every 15th from 3 on)."""
    return {p for p, v in peers.items() if v[1] == CROWD_EPOCH and crowd_index(p) % 15 == 3}


def crowd_failed(peers: dict, epoch: int) -> set[str]:
    """Peers whose round of ``epoch`` failed (in epoch 9's: every 40th from 19 on)."""
    return {p for p in peers if epoch == 9 and crowd_index(p) % 40 == 19}


def crowd_groups(peers: dict, epoch: int) -> list[list[str]]:
    """The groups of ``epoch``'s round: the peers past it (but the failed), in fours by id."""
    members = sorted(p for p, v in peers.items() if v[1] > epoch)
    members = [p for p in members if p not in crowd_failed(peers, epoch)]
    size = CROWD_GROUP_SIZE
    return [members[start : start + size] for start in range(0, len(members), size)]


def crowd_states(peers: dict) -> list[StateAnnouncement]:
    states = []
    for peer_id, (address, epoch, *_) in peers.items():
        digest = f"{crowd_index(peer_id):064x}" if peer_id in crowd_differs(peers) else None
        digest = digest or (GOOD_DIGEST if epoch == CROWD_EPOCH else f"{epoch:064x}")
        states.append(StateAnnouncement(peer_id, epoch, address, (EpochDigest(epoch, digest),)))
    return states


def crowd_round_logs(peers: dict, now: float = NOW) -> list[RoundLogRecord]:
    """Rounds of epochs 7-9: groups of four; epoch 9's first group partial, some peers failed."""
    entries: dict[str, list[RoundEntry]] = {peer_id: [] for peer_id in peers}
    for epoch in CROWD_ROUND_EPOCHS:
        end = now - (CROWD_EPOCH - epoch) * 5.0
        for peer_id in crowd_failed(peers, epoch):
            entries[peer_id].append(RoundEntry(epoch=epoch, end_time=end, status="failed"))
        for index, group in enumerate(crowd_groups(peers, epoch)):
            partial = epoch == 9 and index == 0
            status = "alone" if len(group) == 1 else "partial" if partial else "ok"
            for peer_id in group:
                entry = RoundEntry(
                    epoch=epoch,
                    end_time=end,
                    status=status,
                    group_size=len(group),
                    group_id=group_name(group) if len(group) > 1 else "",
                    duration_s=1.0,
                    averaged_fraction=0.5 if partial else 1.0,
                )
                entries[peer_id].append(entry)
    return [
        RoundLogRecord(
            peer_id=peer_id,
            time=now - 1,
            epoch=peers[peer_id][1],
            target_batch_size=TARGET,
            num_rounds=len(found),
            rounds=tuple(sorted(found, key=lambda e: e.epoch)),
        )
        for peer_id, found in entries.items()
    ]


def crowd_view(num_peers: int = 200) -> SwarmView:
    """A view of the big sample swarm."""
    peers = crowd_peers(num_peers)
    return ViewBuilder(MonitorConfig(run_id="crowd")).build(
        progress=progress(peers=peers),
        profiles=profiles(peers=peers),
        rounds=crowd_round_logs(peers),
        states=crowd_states(peers),
        now=NOW,
    )
