"""The dashboard marks a peer whose replica differs from its group's (from the state digests
every peer announces after each round), and says nothing when the digests do not decide."""

from __future__ import annotations

from monitor.config import MonitorConfig
from monitor.render import plain_line
from monitor.state import ViewBuilder
from peer.records.progress import PeerProgress
from peer.records.state import EpochDigest, StateAnnouncement

NOW = 1_700_000_000.0


def peer_id(index: int) -> str:
    return f"{index:064x}"


def progress(index: int, epoch: int) -> PeerProgress:
    return PeerProgress(
        peer_id(index), epoch, 0, 100.0, NOW, f"http://127.0.0.1:{5000 + index}", False
    )


def announce(index: int, *digests: tuple[int, str]) -> StateAnnouncement:
    entries = tuple(EpochDigest(epoch, letter * 64) for epoch, letter in digests)
    return StateAnnouncement(peer_id(index), entries[-1].epoch, None, entries)


def build(states):
    builder = ViewBuilder(MonitorConfig(run_id="run"))
    records = [progress(i, 7) for i in range(4)]
    return builder.build(progress=records, profiles=(), rounds=(), now=NOW, states=states)


def test_the_peer_whose_digest_differs_is_marked():
    states = [
        announce(0, (6, "a"), (7, "b")),
        announce(1, (7, "b")),
        announce(2, (6, "a"), (7, "b")),
        announce(3, (6, "a"), (7, "c")),  # same start, then another replica
    ]
    view = build(states)
    marked = [peer.peer_id for peer in view.peers if peer.replica_differs]
    assert marked == [peer_id(3)]
    assert any("replica differs" in alert.text for alert in view.alerts)
    assert f"replicas_differ={view.peers[3].short_id}" in plain_line(view)


def test_undecided_digests_mark_nobody():
    tie = [announce(0, (7, "a")), announce(1, (7, "b"))]  # one each: no group to differ from
    assert not any(peer.replica_differs for peer in build(tie).peers)
    assert not any(peer.replica_differs for peer in build([]).peers)
