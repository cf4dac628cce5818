"""What an averaging round is to the collaborative optimizer: its outcome, the counters kept of
rounds, and the interfaces of the averager and the progress tracker it drives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from peer.swarm.progress import GlobalProgress


@dataclass(frozen=True)
class RoundOutcome:
    """What one averaging round did, as the optimizer needs to know it.

    Attributes:
        ok: the tensors now hold the group's weighted average (possibly partial).
        num_peers: group size (1 when alone).
        reason: why the round failed or was partial; empty when it fully succeeded.
        matchmaking_s: seconds spent finding the group.
        allreduce_s: seconds spent in the all-reduce.
        members: peer ids of the group (this peer included).
        epoch: the epoch the round closed (-1 when the averager did not say).
        status: ``ok``, ``partial``, ``alone`` or ``failed`` ("" when the averager did not say).
        sent_bytes, recv_bytes: tensor bytes this peer sent and received in the all-reduce.
        num_dropped: peers dropped from the round.
        averaged_fraction: share of the vector replaced by an average with other peers.
    """

    ok: bool
    num_peers: int
    reason: str = ""
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    members: tuple[str, ...] = ()
    epoch: int = -1
    status: str = ""
    sent_bytes: int = 0
    recv_bytes: int = 0
    num_dropped: int = 0
    averaged_fraction: float = 0.0


class TensorAverager(Protocol):
    """Averages tensors in place with a group of the swarm (blocking; marks its own phases)."""

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
    ) -> RoundOutcome: ...


class PendingRound(Protocol):
    """A round started in the background (delayed updates)."""

    def done(self) -> bool: ...

    def wait(self) -> RoundOutcome: ...


class BackgroundAverager(TensorAverager, Protocol):
    """An averager that can also run a round while the training thread goes on."""

    def start_average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
    ) -> PendingRound: ...


class ProgressSource(Protocol):
    """The progress tracker, as the optimizer uses it.

    ``version`` changes whenever what :meth:`current` extrapolates from changes (new records,
    a round's members): between changes the estimate only moves along its extrapolation.
    """

    @property
    def version(self) -> int: ...

    def report_local_progress(self, epoch: int, samples: int) -> None: ...

    def current(self) -> GlobalProgress: ...

    def note_round(self, epoch: int, peer_ids: Sequence[str]) -> None: ...


@dataclass
class EpochStats:
    """Counters of finished epochs (the metrics stream and the dashboard read them)."""

    num_rounds: int = 0
    num_failed_rounds: int = 0
    num_alone: int = 0
    last_group_size: int = 0
    last_reason: str = ""
    history: list[RoundOutcome] = field(default_factory=list)
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    epoch_samples: list[int] = field(default_factory=list)
