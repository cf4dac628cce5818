"""``peer join``: one volunteer's peer, from start to a clean exit.

The training loop runs in the calling (main) thread; the swarm services run on one event-loop
thread (:mod:`peer.swarm.services`). On start the peer resumes its checkpoint, or downloads the
swarm's
state when the swarm is ahead; then it trains with the collaborative optimizer until a stop
condition, serving fresh state to newcomers and checkpointing as it goes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from averaging.averager import DecentralizedAverager
from dht.identity import PeerIdentity, short_id
from dht.runtime import EventLoopThread
from peer.profiling.metrics_stream import MetricsStream
from peer.profiling.profiler import Profiler, StepProgress
from peer.profiling.prometheus import PeerMetrics
from peer.run.backend import RunSummary
from peer.run.config import PeerConfig
from peer.run.reports import RunReports
from peer.swarm.averager import SwarmAverager
from peer.swarm.catch_up import StateCatchUp
from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.optimizer import CollaborativeOptimizer, averaged_buffers
from peer.swarm.services import SwarmServices, open_services
from peer.train.allocator import steady_allocator
from peer.train.checkpoint import CheckpointDir, Progress
from peer.train.tasks import DataShard, load_task
from peer.train.trainer import StepReport, Trainer, evaluate

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0
# The summary's final loss is the mean over about this many of the last training samples.
FINAL_LOSS_SAMPLES = 2048


def make_optimizer(config: PeerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr)
    return torch.optim.Adam(model.parameters(), lr=config.lr)


def data_seed(config: PeerConfig, identity: PeerIdentity) -> int:
    """This peer's data seed: the configured one, or one derived from its id (peers differ)."""
    if config.seed is not None:
        return config.seed
    return int.from_bytes(hashlib.sha256(identity.peer_id.encode()).digest()[:4], "little")


# Something shown beside the training loop (``peer join --dashboard``): entered once the peer
# has joined, exited when training ends, before the peer leaves the swarm.
Companion = Callable[["PeerRun"], AbstractContextManager]


class PeerRun:
    """One peer's run; :meth:`run` blocks until it stops. See the module docstring.

    Args:
        config: the peer's settings.
        stop_event: set (by a signal handler, a dashboard) to stop training.
        companion: entered beside the training loop once the peer has joined (a dashboard).
    """

    def __init__(
        self,
        config: PeerConfig,
        *,
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
        self.identity = (
            PeerIdentity.load_or_create(config.identity)
            if config.identity
            else PeerIdentity.generate()
        )
        self.task = load_task(config.task, config.task_options())
        model = self.task.build_model()
        self.optimizer = make_optimizer(config, model)
        self.profiler = Profiler(
            config.profiler_config(), process_name=f"peer {short_id(self.identity.peer_id)}"
        )
        self.clock = self.profiler.clock
        self.trainer = Trainer(
            self.task,
            model,
            self.optimizer,
            shard=DataShard(seed=data_seed(config, self.identity)),
            config=config.trainer_config(),
            clock=self.clock,
        )
        self.model = self.trainer.model
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.buffers = averaged_buffers(params, config.mode)
        self.checkpoints = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir else None
        self.loop_thread: EventLoopThread | None = None
        self.services: SwarmServices | None = None
        self.hook: CollaborativeOptimizer | None = None
        self._last_checkpoint_s = time.monotonic()
        self._last_loss: torch.Tensor | None = None
        self._recent_losses: collections.deque[torch.Tensor] = collections.deque(
            maxlen=max(1, math.ceil(FINAL_LOSS_SAMPLES / self.task.batch_size))
        )
        self.metrics: MetricsStream | None = None
        self.reports = RunReports(
            peer_id=self.identity.peer_id,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            publish_interval_s=config.publish_interval,
            metrics=self.prometheus_metrics,
        )

    @property
    def address(self) -> str | None:
        return self.services.transport.address if self.services else None

    def start(self) -> None:
        """Join the swarm: start the services, then resume or download the state."""
        self.trainer.start_data()  # fork loader workers before the network thread exists
        self.loop_thread = EventLoopThread(name=f"vp-{short_id(self.identity.peer_id)}")

        def make_averager(transport, node):
            # called before the transport serves: the moment to add plain GET routes
            self.reports.install(transport)
            return DecentralizedAverager(
                self.buffers,
                transport=transport,
                dht=node,
                prefix=self.config.run_id,
                config=self.config.averager_config(),
            )

        self.services = self.loop_thread.run(
            open_services(self.config, self.identity, make_averager), timeout_s=START_TIMEOUT_S
        )
        logger.info(
            "peer %s joined run %r, serving on %s",
            short_id(self.identity.peer_id),
            self.config.run_id,
            self.address or "nothing (client mode)",
        )
        self.state = StateCatchUp(
            self.config,
            trainer=self.trainer,
            optimizer=self.optimizer,
            services=self.services,
            loop_thread=self.loop_thread,
            clock=self.clock,
        )
        epoch = self._resume()
        self.hook = CollaborativeOptimizer(
            model=self.model,
            optimizer=self.optimizer,
            averager=SwarmAverager(self.services.averager, self.loop_thread, self.clock),
            progress=self.services.tracker,
            config=dataclasses.replace(
                self.config.collaborative_config(),
                # per-step unscaling or clipping needs each step's gradient on its own
                accumulate_in_grad=self.trainer.amp.scaler is None
                and self.config.max_grad_norm is None,
            ),
            on_epoch=self._on_epoch,
            lr_schedule=self.config.lr_schedule_fn(),
            epoch=epoch,
            buffers=self.buffers,
            newcomer_hold=NewcomerHold(self.config.newcomer_hold_config()),
            on_behind=lambda swarm_epoch: self.state.catch_up(swarm_epoch, epoch=self.hook.epoch),
        )
        self.trainer.hook = self.hook
        self.services.tracker.report_local_progress(epoch, 0)
        if self.config.wait_for_peers > 1:
            self._wait_for_peers()
        self.services.state_server.update(self.state.snapshot(epoch))
        if self.config.metrics_file is not None:
            self.metrics = MetricsStream(
                self.config.metrics_file,
                peer_id=self.identity.peer_id,
                run_id=self.config.run_id,
                clock=self.clock,
                counters=self.services.transport.counters,
                interval_s=self.config.metrics_interval,
            )
        self.loop_thread.run(self.services.state_server.announce(), timeout_s=START_TIMEOUT_S)
        self.profiler.attach(
            progress=lambda: StepProgress(
                self.hook.epoch, self.trainer.total_samples, self._last_loss
            ),
            counters=self.services.transport.counters,
            device=str(self.trainer.device),
        )
        self.profiler.start_publishing(
            self.loop_thread,
            dht=self.services.node,
            run_id=self.config.run_id,
            peer_id=self.identity.peer_id,
            timeout_s=START_TIMEOUT_S,
        )
        self.reports.start(
            self.loop_thread, self.services.node, epoch=epoch, timeout_s=START_TIMEOUT_S
        )

    def prometheus_metrics(self) -> PeerMetrics | None:
        """This peer's numbers for a ``/metrics`` scrape (None while it starts); quick, no I/O."""
        hook, services = self.hook, self.services
        if hook is None or services is None:
            return None
        record, stats = self.profiler.last_record, hook.stats
        return PeerMetrics(
            epoch=hook.epoch,
            num_steps=self.trainer.step,
            num_samples=self.trainer.total_samples,
            samples_per_s=record.samples_per_s if record is not None else 0.0,
            phase_s=self.clock.snapshot().seconds,
            sent_bytes=services.transport.counters.sent,
            recv_bytes=services.transport.counters.recv,
            num_rounds=stats.num_rounds,
            num_failed_rounds=stats.num_failed_rounds,
            num_swarm_peers=services.tracker.current().num_peers,
            loss=record.loss if record is not None else None,
        )

    def _recent_loss(self) -> float | None:
        recent = list(self._recent_losses)
        return float(torch.stack(recent).float().mean()) if recent else None

    def _log_rounds(self) -> None:
        self.reports.log_rounds(self.hook.stats, epoch=self.hook.epoch, loss=self._recent_loss)

    def _wait_for_peers(self) -> None:
        """Block until ``wait_for_peers`` peers (this one included) publish progress, so that
        benchmarks and experiments start training together."""
        wanted, tracker = self.config.wait_for_peers, self.services.tracker
        deadline = time.monotonic() + self.config.wait_for_peers_timeout
        while not self.stop_event.is_set():
            swarm = self.loop_thread.run(tracker.refresh(), timeout_s=START_TIMEOUT_S)
            if swarm.num_peers >= wanted:
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "only %d of %d peers after %.0f s; training anyway",
                    swarm.num_peers,
                    wanted,
                    self.config.wait_for_peers_timeout,
                )
                return
            self.stop_event.wait(min(0.2, self.config.publish_interval))

    def _resume(self) -> int:
        epoch = 0
        if self.checkpoints is not None:
            loaded = self.checkpoints.load_latest(model=self.model, optimizer=self.optimizer)
            if loaded is not None:
                epoch = loaded.progress.epoch
                logger.info("resumed from %s at epoch %d", loaded.path, epoch)
        swarm = self.loop_thread.run(self.services.tracker.refresh(), timeout_s=START_TIMEOUT_S)
        if swarm.epoch > epoch:
            epoch = self.state.download(swarm.epoch, fallback=epoch)
        return epoch

    def _on_step(self, report: StepReport) -> None:
        self._last_loss = report.loss_tensor
        self._recent_losses.append(report.loss_tensor)
        if self.metrics is not None:
            self.metrics.maybe_report(
                epoch=self.hook.epoch,
                step=report.step,
                samples=report.samples,
                loss=report.loss_tensor,
            )
        if self.hook.stats.num_rounds != self.reports.num_rounds_logged:
            self._log_rounds()

    def _on_epoch(self, epoch: int) -> None:
        self.profiler.on_epoch(epoch)
        # the state at the start of the epoch: served, and its digest announced
        self.services.state_server.update(self.state.snapshot(epoch))
        self.reports.set_epoch(epoch)
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
                # training starts now: joining and waiting are no part of this peer's rate
                self.services.tracker.report_local_progress(self.hook.epoch, 0)
                result = self.trainer.run(
                    max_steps=self.config.max_steps,
                    max_time_s=self.config.max_time,
                    stop_event=self.stop_event,
                    on_step=self._on_step,
                )
                self.hook.flush()  # a delayed update still in flight
                self._log_rounds()
            eval_loss = evaluate(self.task, self.model)
            if self.checkpoints is not None:
                self._save_checkpoint(self.hook.epoch)
            if self.metrics is not None:
                self.metrics.report(
                    epoch=self.hook.epoch, step=self.trainer.step, loss=self._last_loss
                )
            stopped_by = result.stopped_by
            self.profiler.print_summary()
        finally:
            self.close()
        seconds = time.monotonic() - start
        stats = self.hook.stats
        return RunSummary(
            peer_id=self.identity.peer_id,
            address=None,
            epoch=self.hook.epoch,
            num_steps=self.trainer.step,
            num_samples=self.trainer.total_samples,
            seconds=seconds,
            samples_per_s=self.trainer.total_samples / max(result.elapsed_s, 1e-9),
            final_loss=self._recent_loss(),
            num_rounds=stats.num_rounds,
            num_failed_rounds=stats.num_failed_rounds,
            stopped_by=stopped_by,
            matchmaking_s=stats.matchmaking_s,
            allreduce_s=stats.allreduce_s,
            eval_loss=eval_loss,
        )

    def close(self) -> None:
        """Leave the swarm and stop the loop thread; safe to call twice."""
        self.profiler.close()  # stops publishing before the DHT node closes
        if self.loop_thread is not None:
            self.reports.close(self.loop_thread, timeout_s=START_TIMEOUT_S)
        if self.services is not None and self.loop_thread is not None:
            services, self.services = self.services, None
            self.loop_thread.run(services.close(), timeout_s=START_TIMEOUT_S)
        if self.loop_thread is not None:
            self.loop_thread.close()
        if self.metrics is not None:
            self.metrics.close()
        self.trainer.close()
