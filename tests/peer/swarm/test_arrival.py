"""Which epoch a peer catching up arrives at (peer.swarm.arrival); the end-to-end behaviour
with real peers is tests/peer/run/test_newcomer_fast_epochs.py."""

from __future__ import annotations

import threading

import pytest

from peer.records.progress import PeerProgress
from peer.swarm.arrival import LATE_FACTOR, arrives_late, wait_until_left
from peer.swarm.progress import GlobalProgress

TARGET = 1000


def swarm(
    epoch: int, others: list[int], *, samples: int, eta_s: float, arriving: int = 0
) -> GlobalProgress:
    """The newcomer's estimate: itself (behind, at epoch 0) first, then the others' epochs (the
    first ``arriving`` of them announced ahead of their downloads)."""
    own = PeerProgress("me", 0, 0, 0.0, 0.0, None, False)
    peers = [own] + [
        PeerProgress(f"p{i}", e, 0, 100.0, 0.0, None, False, i < arriving)
        for i, e in enumerate(others)
    ]
    return GlobalProgress(epoch, samples, TARGET, 300.0, eta_s, len(peers), 0, tuple(peers))


@pytest.mark.parametrize(
    ("estimate", "late"),
    [
        (swarm(5, [5, 5, 5], samples=TARGET, eta_s=0.0), True),  # its round is starting
        (swarm(5, [5, 5, 5], samples=900, eta_s=LATE_FACTOR * 0.5), True),  # before a download
        (swarm(5, [5, 5, 5], samples=100, eta_s=LATE_FACTOR * 2.0), False),  # time to arrive
        (swarm(5, [5, 5], samples=TARGET, eta_s=0.0), True),  # two are a swarm with a round
        (swarm(5, [5], samples=TARGET, eta_s=0.0), False),  # a lone peer holds for it instead
        (swarm(5, [5, 4, 4], samples=TARGET, eta_s=0.0), False),  # one at 5 only
        (swarm(6, [6, 6, 6], samples=TARGET, eta_s=0.0), False),  # not the epoch asked for
        # two of the three only announced their arrival: one peer is there, no round to miss
        (swarm(5, [5, 5, 5], samples=TARGET, eta_s=0.0, arriving=2), False),
        (swarm(5, [5, 5, 5], samples=TARGET, eta_s=0.0, arriving=1), True),
    ],
)
def test_a_download_arrives_late_only_at_a_swarm_about_to_start_its_round(estimate, late):
    assert arrives_late(estimate, 5, download_s=1.0) is late


def test_the_wait_ends_when_the_swarm_leaves_the_epoch():
    estimates = iter([swarm(5, [5, 5], samples=TARGET, eta_s=0.0)] * 3)
    after = swarm(6, [6, 6], samples=0, eta_s=1.0)
    assert wait_until_left(
        lambda: next(estimates, after), 5, timeout_s=30.0, stop_event=threading.Event()
    )


def test_the_wait_is_bounded_and_ends_when_the_peer_stops():
    staying = swarm(5, [5, 5], samples=TARGET, eta_s=0.0)
    assert not wait_until_left(lambda: staying, 5, timeout_s=0.05, stop_event=threading.Event())
    stopped = threading.Event()
    stopped.set()
    assert not wait_until_left(lambda: staying, 5, timeout_s=30.0, stop_event=stopped)
