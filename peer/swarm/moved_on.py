"""When the swarm has left an epoch for good, and the search for a group that stops then.

A round looks for its group until its matchmaking time runs out. Once every other peer has left
the round's epoch nobody is coming, and a peer still looking would enter the next epoch late:
the others then plan that round from a read that shows it an epoch behind, and leave it out
again. Both the collaborative optimizer and ``peer bench swarm``'s light peers stop their search
here. Torch-free, so that light peers do not load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from peer.swarm.progress import GlobalProgress

# The reason of a round that stopped looking because the swarm had left its epoch.
MOVED_ON = "the swarm moved on to epoch"


class CurrentProgress(Protocol):
    """What reads the swarm's estimate (the progress tracker)."""

    def current(self) -> GlobalProgress: ...


def has_left(swarm: GlobalProgress, epoch: int) -> bool:
    """Whether the swarm has left ``epoch`` for good: two or more epochs on, or one on with
    nobody else's record still at ``epoch`` (as
    :meth:`peer.swarm.readiness.Readiness.behind` reads it)."""
    if swarm.epoch <= epoch:
        return False
    return swarm.epoch > epoch + 1 or not any(peer.epoch == epoch for peer in swarm.peers[1:])


def moved_on(progress: CurrentProgress, epoch: int) -> Callable[[], int | None]:
    """Asked on the event loop while a round of ``epoch`` looks for a group: the swarm's epoch
    once it has left ``epoch`` (nobody will come any more), else None."""

    def check() -> int | None:
        swarm = progress.current()
        return swarm.epoch if has_left(swarm, epoch) else None

    return check


def stop_when_moved_on(moved_on: Callable[[], int | None]) -> Callable[[], str | None]:
    """A search's ``stop_when`` that ends it once ``moved_on`` names the swarm's new epoch,
    with the reason :data:`MOVED_ON` and that epoch."""

    def stop_when() -> str | None:
        swarm_epoch = moved_on()
        return None if swarm_epoch is None else f"{MOVED_ON} {swarm_epoch}"

    return stop_when
