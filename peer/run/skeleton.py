"""What every peer's run shares, whichever backend averages: the task, model, local optimizer,
trainer and profiler, the recent-loss window, checkpoint cadence, the metrics stream, the
companion dashboard, and the order of a run (start, train, evaluate, save, summarize, close).

:class:`peer.run.runner.PeerRun` (native) and :class:`peer.hivemind.backend.HivemindPeerRun`
fill in how a peer joins the swarm (:meth:`RunSkeleton.start`), leaves it
(:meth:`RunSkeleton.close`) and what its epoch and round counters are.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from peer.profiling.metrics_stream import MetricsStream
from peer.profiling.profiler import Profiler
from peer.run.backend import RunSummary
from peer.run.config import PeerConfig
from peer.swarm.round import EpochStats
from peer.train.allocator import steady_allocator
from peer.train.checkpoint import CheckpointDir, Progress
from peer.train.tasks import DataShard, load_task
from peer.train.trainer import RunResult, StepReport, Trainer, evaluate

logger = logging.getLogger(__name__)
# Bound on each blocking start and stop step (joining the swarm, leaving it), in seconds.
START_TIMEOUT_S = 60.0
# The summary's final loss is the mean over about this many of the last training samples.
FINAL_LOSS_SAMPLES = 2048

# Something shown beside the training loop (``peer join --dashboard``): entered once the peer
# has joined, exited when training ends, before the peer leaves the swarm.
Companion = Callable[[Any], AbstractContextManager]


def make_optimizer(config: PeerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The local optimizer ``config.optimizer`` names, at ``config.lr``."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr)
    return torch.optim.Adam(model.parameters(), lr=config.lr)


class RunSkeleton:
    """One peer's run, less the swarm; :meth:`run` blocks until it stops.

    Args:
        config: the peer's settings.
        process_name: the profiler's name of this process (in the Perfetto trace).
        data_seed: this peer's data seed.
        stop_event: set (by a signal handler, a dashboard) to stop training.
        companion: entered beside the training loop once the peer has joined (a dashboard).
    """

    def __init__(
        self,
        config: PeerConfig,
        *,
        process_name: str,
        data_seed: int,
        stop_event: threading.Event | None = None,
        companion: Companion | None = None,
    ):
        self.config = config
        self.stop_event = stop_event or threading.Event()
        self.companion = companion
        if config.torch_threads is not None:
            # peers sharing a machine must not oversubscribe its cores: torch's spinning
            # threads then slow every step many times over
            torch.set_num_threads(config.torch_threads)
        if config.steady_allocator:
            steady_allocator()  # before the model and its gradients are allocated
        self.task = load_task(config.task, config.task_options())
        model = self.task.build_model()
        self.optimizer = make_optimizer(config, model)
        self.profiler = Profiler(config.profiler_config(), process_name=process_name)
        self.clock = self.profiler.clock
        self.trainer = Trainer(
            self.task,
            model,
            self.optimizer,
            shard=DataShard(seed=data_seed),
            config=config.trainer_config(),
            clock=self.clock,
        )
        self.model = self.trainer.model
        self.checkpoints = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir else None
        self.metrics: MetricsStream | None = None
        self._last_loss: torch.Tensor | None = None
        self._recent_losses: collections.deque[torch.Tensor] = collections.deque(
            maxlen=max(1, math.ceil(FINAL_LOSS_SAMPLES / self.task.batch_size))
        )
        self._last_checkpoint_s = time.monotonic()

    # ---- what a backend fills in -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The peer's swarm epoch."""
        raise NotImplementedError

    @property
    def stats(self) -> EpochStats:
        """The peer's round counters."""
        raise NotImplementedError

    @property
    def peer_id(self) -> str:
        raise NotImplementedError

    @property
    def address(self) -> str | None:
        raise NotImplementedError

    def start(self) -> None:
        """Join the swarm and get ready to train."""
        raise NotImplementedError

    def close(self) -> None:
        """Leave the swarm; safe to call twice."""
        raise NotImplementedError

    def _before_training(self) -> None:
        """Called once the companion is up, right before the loop (training starts now)."""

    def _after_training(self) -> None:
        """Called right after the loop, before the companion exits."""

    def _on_step(self, report: StepReport) -> None:
        self._note_step(report)

    # ---- shared ------------------------------------------------------------------------------

    def _open_metrics(self, peer_id: str, counters: Any) -> None:
        if self.config.metrics_file is not None:
            self.metrics = MetricsStream(
                self.config.metrics_file,
                peer_id=peer_id,
                run_id=self.config.run_id,
                clock=self.clock,
                counters=counters,
                interval_s=self.config.metrics_interval,
            )

    def _resume_checkpoint(self) -> int:
        """The epoch of the latest checkpoint, loaded into the model and optimizer (0: none)."""
        if self.checkpoints is None:
            return 0
        loaded = self.checkpoints.load_latest(model=self.model, optimizer=self.optimizer)
        if loaded is None:
            return 0
        logger.info("resumed from %s at epoch %d", loaded.path, loaded.progress.epoch)
        return loaded.progress.epoch

    def _note_step(self, report: StepReport) -> None:
        """After every local step: the loss window and the metrics stream."""
        self._last_loss = report.loss_tensor
        self._recent_losses.append(report.loss_tensor)
        if self.metrics is not None:
            self.metrics.maybe_report(
                epoch=self.epoch, step=report.step, samples=report.samples, loss=report.loss_tensor
            )

    def _recent_loss(self) -> float | None:
        """The mean training loss over the last ``FINAL_LOSS_SAMPLES`` samples, or None."""
        recent = list(self._recent_losses)
        return float(torch.stack(recent).float().mean()) if recent else None

    def _at_boundary(self, epoch: int) -> None:
        """At an epoch boundary: the ``max_epochs`` stop and the checkpoint cadence."""
        if self.config.max_epochs is not None and epoch >= self.config.max_epochs:
            self.stop_event.set()
        now = time.monotonic()
        if self.checkpoints and now - self._last_checkpoint_s >= self.config.checkpoint_interval:
            self._save_checkpoint(epoch)
            self._last_checkpoint_s = now

    def _save_checkpoint(self, epoch: int) -> None:
        self.checkpoints.save(
            model=self.model,
            optimizer=self.optimizer,
            progress=Progress(
                epoch=epoch, step=self.trainer.step, samples=self.trainer.total_samples
            ),
        )

    def run(self) -> RunSummary:
        """Start, train until a stop condition, leave cleanly; returns the summary."""
        start = time.monotonic()
        try:
            self.start()
            with self.companion(self) if self.companion else nullcontext():
                self._before_training()
                result = self.trainer.run(
                    max_steps=self.config.max_steps,
                    max_time_s=self.config.max_time,
                    stop_event=self.stop_event,
                    on_step=self._on_step,
                )
                self._after_training()
            eval_loss = evaluate(self.task, self.model)
            if self.checkpoints is not None:
                self._save_checkpoint(self.epoch)
            if self.metrics is not None:
                self.metrics.report(epoch=self.epoch, step=self.trainer.step, loss=self._last_loss)
            self.profiler.print_summary()
            summary = self._summary(result, time.monotonic() - start, eval_loss)
        finally:
            self.close()
        return summary

    def _summary(self, result: RunResult, seconds: float, eval_loss: float | None) -> RunSummary:
        stats = self.stats
        return RunSummary(
            peer_id=self.peer_id,
            address=self.address,
            epoch=self.epoch,
            num_steps=self.trainer.step,
            num_samples=self.trainer.total_samples,
            seconds=seconds,
            samples_per_s=self.trainer.total_samples / max(result.elapsed_s, 1e-9),
            final_loss=self._recent_loss(),
            num_rounds=stats.num_rounds,
            num_failed_rounds=stats.num_failed_rounds,
            stopped_by=result.stopped_by,
            matchmaking_s=stats.matchmaking_s,
            allreduce_s=stats.allreduce_s,
            eval_loss=eval_loss,
        )
