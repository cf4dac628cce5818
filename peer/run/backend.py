"""The one interface behind which the peer's two backends sit.

``peer join``, ``peer demo``, the benchmarks and the experiments build a peer with
:func:`peer.run.make.make_peer_run`: the native backend (:class:`peer.run.runner.PeerRun`, our DHT,
transport and averager) or the hivemind backend (:class:`peer.hivemind.backend.HivemindPeerRun`,
hivemind.DHT and hivemind.Optimizer), chosen by ``config.backend``. Both train the same task with
the same :class:`peer.train.trainer.Trainer` and :class:`peer.profiling.phases.PhaseClock`; neither
imports the other, and each is imported only when chosen (hivemind is an optional extra).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """How a peer's run went, in either backend; the fields of ``peer join --json``.

    Attributes:
        peer_id: the peer's id in its backend's format.
        address: where it served (URL or multiaddr), if it did.
        epoch: the swarm epoch it ended at.
        num_steps, num_samples: local steps and samples trained.
        seconds: wall time of the whole run, start-up included.
        samples_per_s: samples over the training loop's time.
        final_loss: mean loss over about the last 2048 samples.
        num_rounds, num_failed_rounds: averaging rounds waited for, and those that failed.
        stopped_by: why the loop stopped.
        matchmaking_s, allreduce_s: seconds the training thread waited for groups and
            all-reduces.
        eval_loss: the task's evaluation loss after training (None without an eval set).
    """

    peer_id: str
    address: str | None
    epoch: int
    num_steps: int
    num_samples: int
    seconds: float
    samples_per_s: float
    final_loss: float | None
    num_rounds: int
    num_failed_rounds: int
    stopped_by: str
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    eval_loss: float | None = None


class PeerRunner(Protocol):
    """A peer of either backend: ``run`` blocks until a stop condition; ``close`` is idempotent."""

    stop_event: threading.Event

    def run(self) -> RunSummary: ...

    def close(self) -> None: ...
