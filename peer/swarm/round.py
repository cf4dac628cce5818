"""What an averaging round is to the collaborative optimizer: the interfaces of the averager and
the progress tracker it drives, the counters kept of rounds, and a round's record entry.

A round is one type from the averager to the dashboard: the averager's
:class:`averaging.result.RoundResult` (with the epoch it closed) is what the optimizer counts,
and :func:`round_entry` turns it into the torch-free :class:`peer.records.rounds.RoundEntry`
that the round record publishes (the hivemind backend builds its results the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from averaging.result import RoundResult
from dht.config import get_dht_time
from peer.records.rounds import RoundEntry, group_name
from peer.swarm.progress import GlobalProgress


def alone(epoch: int, reason: str = "alone") -> RoundResult:
    """The round of a peer with nobody at its epoch: it steps on its own contribution."""
    return RoundResult("alone", reason, epoch=epoch)


def failed(epoch: int, reason: str) -> RoundResult:
    """A round that averaged nothing (the peer steps on its own contribution)."""
    return RoundResult("failed", reason, epoch=epoch)


class TensorAverager(Protocol):
    """Averages the optimizer's buffers in place with a group of the swarm.

    The averager is built over those buffers; ``tensors`` names them again so that a reader of
    the call sees what changes (an averager refuses any other tensors). Blocking; it marks its
    own phases.
    """

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
        moved_on: Callable[[], int | None] | None = None,
    ) -> RoundResult:
        """``moved_on``: asked while looking for a group; an epoch once the swarm has left
        this one (nobody will come), which ends the search at once ("alone")."""
        ...

    def start_average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
    ) -> PendingRound:
        """Start a round in the background (delayed updates); the tensors stay untouched until
        it ends."""
        ...


class PendingRound(Protocol):
    """A round started in the background (delayed updates)."""

    def done(self) -> bool: ...

    def wait(self) -> RoundResult: ...


class ProgressSource(Protocol):
    """The progress tracker, as the optimizer uses it.

    ``version`` changes whenever what :meth:`current` extrapolates from changes (new records,
    a round's members): between changes the estimate only moves along its extrapolation.
    """

    @property
    def version(self) -> int: ...

    @property
    def partners(self) -> frozenset[str]:
        """The peers of this peer's last rounds, whose samples alone count toward the target
        when they are here (see :mod:`peer.swarm.progress`)."""
        ...

    def report_local_progress(self, epoch: int, samples: int) -> None: ...

    def current(self) -> GlobalProgress: ...

    def note_round(self, epoch: int, peer_ids: Sequence[str], num_reached: int = 0) -> None: ...


class StateSource(Protocol):
    """Where a peer that fell behind gets the swarm's state (:mod:`peer.swarm.catch_up`)."""

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        """Load the state of ``swarm_epoch`` (or the latest); the epoch now reached (``epoch``,
        this peer's own, when it failed)."""
        ...


@dataclass
class EpochStats:
    """Counters of finished rounds, kept by whoever runs them (the collaborative optimizer, or
    the hivemind hook); the metrics, the round record and the run summary read them."""

    num_rounds: int = 0
    num_failed_rounds: int = 0
    num_alone: int = 0
    last_group_size: int = 0
    history: list[RoundResult] = field(default_factory=list)
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    epoch_samples: list[int] = field(default_factory=list)

    def add(self, result: RoundResult) -> None:
        """Count one finished round."""
        self.num_rounds += 1
        self.last_group_size = result.num_peers
        self.history = [*self.history[-99:], result]
        self.matchmaking_s += result.matchmaking_s
        self.allreduce_s += result.allreduce_s
        if not result.ok:
            self.num_failed_rounds += 1
        elif result.num_peers <= 1:
            self.num_alone += 1


def round_entry(result: RoundResult, *, epoch: int, loss: float | None) -> RoundEntry:
    """The round record's entry for one finished round (``epoch``: the epoch it closed, when
    the result does not say)."""
    return RoundEntry(
        epoch=result.epoch if result.epoch >= 0 else epoch,
        end_time=get_dht_time(),
        status=result.status,
        group_size=result.num_peers,
        group_id=group_name(result.members),
        duration_s=result.matchmaking_s + result.allreduce_s,
        sent_bytes=result.bytes_sent,
        recv_bytes=result.bytes_received,
        num_dropped=result.num_dropped,
        averaged_fraction=result.averaged_fraction,
        loss=loss,
        reason="" if result.status == "ok" else result.reason,
    )
