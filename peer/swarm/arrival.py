"""Which epoch a peer that downloads the swarm's state arrives at (issue 24).

A peer catching up downloads the state of the swarm's epoch E and takes part in E's round. With
epochs about as short as a download (a demo's sub-second epochs), the peers at E start that
round before the download ends, sized for themselves alone (``expected_peers``): their group
closes in milliseconds without the newcomer, which then finds the swarm gone, downloads again,
and arrives late again, every epoch.

So when the swarm's round of E will start before a download could end (its estimate reached the
target, or its ETA is shorter than ``LATE_FACTOR`` downloads), the peer arrives at E + 1
instead: its record says E + 1 at once, marked as an arrival (the peers at E do not count it, so
their round of E waits for nobody; and no peer takes it for the swarm's epoch, nor for a peer
there when it decides its own arrival: arrivals counted as positions pulled whole rows into
arriving further and further ahead of where anyone was), it waits for the swarm to leave E, then
downloads the state of E + 1. The swarm's peers read its record during all of E + 1 and count it
in E + 1's ``expected_peers``: their group waits for it (the download's time). It joins with the
very state they hold, so in ``grad`` mode every replica stays the same. A swarm that is not
about to start a round gets the download of E at once (no waiting), and that peer's record says
E during the download, which puts it into E's round as well
(:meth:`peer.swarm.catch_up.StateCatchUp.download`).

Only a swarm of two or more peers at E is skipped that way: a lone peer holds its boundary for
a peer behind it instead (:mod:`peer.swarm.newcomer_hold`), and one record ahead of a single
other peer would be read as the swarm's epoch (:mod:`peer.swarm.progress` takes the epoch of a
majority of the others).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from peer.swarm.progress import GlobalProgress

# The swarm's round is taken to start before a download ends when its ETA is shorter than this
# many downloads (a download's time varies with the donors' load; joining takes a step more).
LATE_FACTOR = 2.0
# A download's time assumed before this peer has timed one, in seconds.
FIRST_DOWNLOAD_S = 1.0
# How often the wait for the swarm to leave an epoch reads the estimate (no network), seconds.
LEAVE_POLL_S = 0.02


def arrives_late(swarm: GlobalProgress, epoch: int, *, download_s: float) -> bool:
    """Whether a download of ``epoch``'s state (taking about ``download_s``) would end after the
    peers there started its round: two or more are there (``swarm.peers[1:]``), and the swarm
    reached its target or will within ``LATE_FACTOR`` downloads."""
    there = sum(peer.epoch == epoch and not peer.arriving for peer in swarm.peers[1:])
    if swarm.epoch != epoch or there < 2:
        return False
    return swarm.ready or swarm.eta_next_epoch_s < LATE_FACTOR * download_s


def wait_until_left(
    current: Callable[[], GlobalProgress],
    epoch: int,
    *,
    timeout_s: float,
    stop_event: threading.Event,
) -> bool:
    """Wait until the swarm (``current``, read without network) is past ``epoch``; False when
    ``timeout_s`` ran out or ``stop_event`` was set first."""
    deadline_s = time.monotonic() + timeout_s
    while not stop_event.is_set():
        if current().epoch > epoch:
            return True
        if time.monotonic() >= deadline_s:
            return False
        stop_event.wait(LEAVE_POLL_S)
    return False
