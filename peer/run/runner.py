"""``peer join``: one volunteer's peer, from start to a clean exit.

The training loop runs in the calling (main) thread; the swarm services run on one event-loop
thread (:mod:`peer.swarm.services`). On start the peer resumes its checkpoint, or downloads the
swarm's state when the swarm is ahead; then it trains with the collaborative optimizer until a
stop condition, serving fresh state to newcomers and checkpointing as it goes. What it shares
with the hivemind backend (task, trainer, profiler, checkpoints, the order of a run) is
:class:`peer.run.skeleton.RunSkeleton`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time

from dht.identity import PeerIdentity, short_id
from dht.reachability import Reachability, reachability_line
from dht.runtime import EventLoopThread
from peer.profiling.profiler import StepProgress
from peer.profiling.prometheus import PeerMetrics
from peer.run.config import PeerConfig
from peer.run.reports import RunReports
from peer.run.skeleton import START_TIMEOUT_S, Companion, RunSkeleton
from peer.swarm.averager import SwarmAverager
from peer.swarm.catch_up import StateCatchUp
from peer.swarm.epoch import Epoch
from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.optimizer import CollaborativeOptimizer, make_contribution
from peer.swarm.round import EpochStats
from peer.swarm.services import SwarmServices, open_services
from peer.train.trainer import StepReport

logger = logging.getLogger(__name__)


def data_seed(config: PeerConfig, identity: PeerIdentity) -> int:
    """This peer's data seed: the configured one, or one derived from its id (peers differ)."""
    if config.seed is not None:
        return config.seed
    return int.from_bytes(hashlib.sha256(identity.peer_id.encode()).digest()[:4], "little")


class PeerRun(RunSkeleton):
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
        self.identity = (
            PeerIdentity.load_or_create(config.identity)
            if config.identity
            else PeerIdentity.generate()
        )
        super().__init__(
            config,
            process_name=f"peer {short_id(self.identity.peer_id)}",
            data_seed=data_seed(config, self.identity),
            stop_event=stop_event,
            companion=companion,
        )
        self.collaborative_config = dataclasses.replace(
            config.collaborative_config(),
            # per-step unscaling or clipping needs each step's gradient on its own
            accumulate_in_grad=self.trainer.amp.scaler is None and config.max_grad_norm is None,
        )
        self.contribution = make_contribution(self.model, self.optimizer, self.collaborative_config)
        self.epoch_counter: Epoch | None = None
        self.loop_thread: EventLoopThread | None = None
        self.services: SwarmServices | None = None
        self.hook: CollaborativeOptimizer | None = None
        self.reports = RunReports(
            peer_id=self.identity.peer_id,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            publish_interval_s=config.publish_interval,
            metrics=self.prometheus_metrics,
        )

    @property
    def epoch(self) -> int:
        return self.epoch_counter.value if self.epoch_counter is not None else 0

    @property
    def stats(self) -> EpochStats:
        return self.hook.stats

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def address(self) -> str | None:
        return self.services.transport.address if self.services else None

    @property
    def reachability(self) -> Reachability:
        """What the peer learned at join about how the swarm reaches it."""
        found = self.services.transport.reachability if self.services else None
        return found or Reachability(reachable=None, address=self.address, reason="not checked")

    def start(self) -> None:
        """Join the swarm: start the services, then resume or download the state."""
        self.trainer.start_data()  # fork loader workers before the network thread exists
        self.loop_thread = EventLoopThread(name=f"vp-{short_id(self.identity.peer_id)}")
        self.services = self.loop_thread.run(
            open_services(
                self.config,
                self.identity,
                tensors=self.contribution.buffers,
                routes=(self.reports.install,),
            ),
            timeout_s=START_TIMEOUT_S,
        )
        logger.info(
            "peer %s joined run %r, serving on %s",
            short_id(self.identity.peer_id),
            self.config.run_id,
            self.address or "nothing (client mode)",
        )
        logger.info("%s", reachability_line(self.reachability))
        self.state = StateCatchUp(
            self.config,
            trainer=self.trainer,
            optimizer=self.optimizer,
            services=self.services,
            loop_thread=self.loop_thread,
            clock=self.clock,
        )
        epoch = self._resume()
        self.epoch_counter = Epoch(epoch)
        self.hook = CollaborativeOptimizer(
            model=self.model,
            optimizer=self.optimizer,
            averager=SwarmAverager(self.services.averager, self.loop_thread, self.clock),
            progress=self.services.tracker,
            config=self.collaborative_config,
            epoch=self.epoch_counter,
            contribution=self.contribution,
            lr_schedule=self.config.lr_schedule_fn(),
            state=self.state,
            newcomer_hold=NewcomerHold(self.config.newcomer_hold_config()),
        )
        self.epoch_counter.subscribe(self._on_epoch)
        self.trainer.hook = self.hook
        self.services.tracker.report_local_progress(epoch, 0)
        if self.config.wait_for_peers > 1:
            self._wait_for_peers()
        self.services.state_server.update(self.state.snapshot(epoch))
        self._open_metrics(self.identity.peer_id, self.services.transport.counters)
        self.loop_thread.run(self.services.state_server.announce(), timeout_s=START_TIMEOUT_S)
        self.profiler.attach(
            progress=lambda: StepProgress(self.epoch, self.trainer.total_samples, self._last_loss),
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
            deadlines_s=services.averager.deadlines.snapshot(),
        )

    def _log_rounds(self) -> None:
        self.reports.log_rounds(self.hook.stats, epoch=self.epoch, loss=self._recent_loss)

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
        """The epoch to start at: the checkpoint's, or the swarm's after a state download."""
        epoch = self._resume_checkpoint()
        swarm = self.loop_thread.run(self.services.tracker.refresh(), timeout_s=START_TIMEOUT_S)
        if swarm.epoch > epoch:
            epoch = self.state.download(swarm.epoch, fallback=epoch)
        return epoch

    def _on_step(self, report: StepReport) -> None:
        self._note_step(report)
        if self.hook.stats.num_rounds != self.reports.num_rounds_logged:
            self._log_rounds()

    def _on_epoch(self, epoch: int) -> None:
        """At every epoch boundary (a round or a catch-up; :class:`Epoch` calls it)."""
        self.profiler.on_epoch(epoch)
        # the state at the start of the epoch: served, and its digest announced
        self.services.state_server.update(self.state.snapshot(epoch))
        self.reports.set_epoch(epoch)
        self._at_boundary(epoch)

    def _before_training(self) -> None:
        # training starts now: joining and waiting are no part of this peer's rate
        self.services.tracker.report_local_progress(self.epoch, 0)

    def _after_training(self) -> None:
        self.hook.flush()  # a delayed update still in flight
        self._log_rounds()

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
