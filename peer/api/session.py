"""What a peer runs beside its training loop, the one wiring of the swarm side for the library
(:class:`peer.Optimizer`) and for ``peer join`` (:class:`peer.run.runner.PeerRun`): services on
a :class:`peer.DHT`, the collaborative optimizer, state catch-up and serving, the profiler and
its DHT record, the round record, ``/metrics`` and the metrics stream."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from peer.api.dht import DHT
from peer.api.swarm import LoopCounts
from peer.profiling.metrics_stream import MetricsStream
from peer.profiling.profiler import Profiler, StepProgress
from peer.profiling.prometheus import PeerMetrics
from peer.run.reports import RunReports
from peer.swarm.averager import SwarmAverager
from peer.swarm.catch_up import StateCatchUp
from peer.swarm.contribution import Contribution
from peer.swarm.epoch import Epoch
from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.optimizer import CollaborativeOptimizer
from peer.swarm.optimizer_config import CollaborativeConfig, make_contribution
from peer.swarm.progress import GlobalProgress
from peer.swarm.services import open_services
from peer.swarm.split_hold import SplitHold

logger = logging.getLogger(__name__)
# Bound on each start and stop call to the network thread, in seconds.
CALL_TIMEOUT_S = 60.0


class Session:
    """One peer's swarm side, beside a training loop: the library's (built by
    :class:`peer.Optimizer`, closed by its ``shutdown``) and ``peer join``'s
    (:class:`peer.run.runner.PeerRun`). The DHT stays its owner's.

    Args:
        config: the settings (a :class:`peer.run.config.PeerConfig`, or the library's
            :class:`peer.api.options.LibraryConfig`).
        dht: the running DHT.
        optimizer: the wrapped (inner) optimizer.
        counts: the loop's model (whose state is served and loaded), step and sample counts
            (a :class:`peer.api.swarm.LoopCounts` or a :class:`peer.train.trainer.Trainer`);
            its ``device``, when it has one, names the device in the profile record.
        collaborative: the collaborative optimizer's settings.
        on_epoch: called with each new epoch (after the session's own bookkeeping).
        last_loss: ``() -> the last step's loss`` (or None) for the profiler.
        process_name: the trace's process name (when the session makes the profiler).
        on_behind: ``swarm_epoch -> epoch reached``: the catch-up the collaborative optimizer
            asks for when the swarm is ahead (None: a download, :meth:`catch_up`).
        profiler: the loop's profiler, whose clock the rounds are charged to (None: the
            session makes one from ``config``).
        start_epoch: the epoch of the state the loop starts with (a checkpoint's); the swarm's
            state is downloaded when the swarm is ahead of it.
        stop_event: when set, waiting for peers at the start ends.
    """

    def __init__(
        self,
        config,
        *,
        dht: DHT,
        optimizer: torch.optim.Optimizer,
        counts: LoopCounts,
        collaborative: CollaborativeConfig,
        on_epoch: Callable[[int], None],
        last_loss: Callable[[], Any],
        process_name: str = "peer",
        on_behind: Callable[[int], int] | None = None,
        profiler: Profiler | None = None,
        start_epoch: int = 0,
        stop_event: threading.Event | None = None,
    ):
        self.config, self.dht, self.counts = config, dht, counts
        self.loop_thread = dht.loop_thread
        self.stop_event = stop_event or threading.Event()
        self.profiler = profiler or Profiler(config.profiler_config(), process_name=process_name)
        contribution = make_contribution(counts.model, optimizer, collaborative)
        self.reports = RunReports(
            peer_id=dht.peer_id,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            publish_interval_s=config.publish_interval,
            metrics=self.prometheus_metrics,
        )
        self.metrics: MetricsStream | None = None
        self.hook: CollaborativeOptimizer | None = None
        self._closed = self._left = False
        if dht.serves_metrics:  # the run's labels from now on; its numbers once it has joined
            dht.attach_metrics(self.reports.exporter)
        try:
            self.services = self.loop_thread.run(
                open_services(config, tensors=contribution.buffers, node=dht.node),
                timeout_s=CALL_TIMEOUT_S,
            )
        except BaseException:
            dht.attach_metrics(None)
            raise
        try:
            self._open(optimizer, contribution, collaborative, on_behind, start_epoch)
            self._on_epoch_user = on_epoch
            self.epoch.subscribe(self._on_epoch)
            self.epoch.subscribe_state(self._serve_state)
            self._start(self.epoch.value, last_loss)
        except BaseException:
            self.close(last_loss=None, summary=False, timeout_s=CALL_TIMEOUT_S)
            raise

    def _open(
        self,
        optimizer: torch.optim.Optimizer,
        contribution: Contribution,
        collaborative: CollaborativeConfig,
        on_behind: Callable[[int], int] | None,
        start_epoch: int,
    ) -> None:
        """State catch-up, the epoch (after a download when the swarm is ahead) and the
        collaborative optimizer."""
        config, clock = self.config, self.profiler.clock
        self.state = StateCatchUp(
            config,
            trainer=self.counts,
            optimizer=optimizer,
            services=self.services,
            loop_thread=self.loop_thread,
            clock=clock,
            stop_event=self.stop_event,
            outer=contribution.outer_optimizer,
        )
        if config.wait_for_peers > 1:
            self.services.tracker.report_local_progress(start_epoch, 0)
            self._wait_for_peers()
        # the stream's first interval starts here: waiting for peers is none of the peer's time,
        # a download of the swarm's state is
        self._open_metrics()
        self.epoch = Epoch(self._initial_epoch(start_epoch))
        # the contribution was made over the model before a download replaced it: in diloco
        # its anchor (and replica) would still be the model's initial values, and the first
        # outer step would go from there
        contribution.discard()
        self.hook = CollaborativeOptimizer(
            model=self.counts.model,
            optimizer=optimizer,
            averager=SwarmAverager(self.services.averager, self.loop_thread, clock),
            progress=self.services.tracker,
            config=collaborative,
            epoch=self.epoch,
            contribution=contribution,
            lr_schedule=config.lr_schedule_fn(),
            state=self.state if on_behind is None else _CatchUp(on_behind),
            newcomer_hold=NewcomerHold(config.newcomer_hold_config()),
            split_hold=SplitHold(config.split_hold_config()),
            replicas=self.state,  # the library's too: a replica that differs re-syncs
        )

    def _initial_epoch(self, start_epoch: int) -> int:
        swarm = self.refresh()
        if swarm.epoch > start_epoch:
            return self.state.download(swarm.epoch, fallback=start_epoch)
        return start_epoch

    def _start(self, epoch: int, last_loss: Callable[[], Any]) -> None:
        services, config = self.services, self.config
        services.tracker.report_local_progress(epoch, 0)
        services.state_server.update(self.state.snapshot(epoch))
        self.loop_thread.run(services.state_server.announce(), timeout_s=CALL_TIMEOUT_S)
        device = getattr(self.counts, "device", None)

        def num_peers() -> float:  # the swarm's size as the last progress read counted it
            return services.tracker.global_progress.num_peers

        self.profiler.attach(
            progress=lambda: StepProgress(self.hook.epoch, self.counts.total_samples, last_loss()),
            counters=services.transport.counters,
            device=str(device if device is not None else _device_of(self.counts.model)),
        )
        self.profiler.start_publishing(
            self.loop_thread,
            dht=services.node,
            run_id=config.run_id,
            peer_id=self.dht.peer_id,
            timeout_s=CALL_TIMEOUT_S,
            num_peers=num_peers,
        )
        self.reports.start(
            self.loop_thread,
            services.node,
            epoch=epoch,
            timeout_s=CALL_TIMEOUT_S,
            num_peers=num_peers,
        )
        services.tracker.report_local_progress(epoch, 0)  # training starts now

    def _open_metrics(self) -> None:
        config = self.config
        if config.metrics_file is not None:
            self.metrics = MetricsStream(
                config.metrics_file,
                peer_id=self.dht.peer_id,
                run_id=config.run_id,
                clock=self.profiler.clock,
                counters=self.services.transport.counters,
                interval_s=config.metrics_interval,
            )

    def _wait_for_peers(self) -> None:
        """Block until ``wait_for_peers`` peers (this one included) publish progress, so that
        benchmarks and experiments start training together."""
        wanted = self.config.wait_for_peers
        deadline = time.monotonic() + self.config.wait_for_peers_timeout
        while not self.stop_event.is_set():
            swarm = self.refresh()
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

    # ---- called from the optimizer -------------------------------------------------------

    def refresh(self) -> GlobalProgress:
        """Read the swarm's progress now (blocking)."""
        return self.loop_thread.run(self.services.tracker.refresh(), timeout_s=CALL_TIMEOUT_S)

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        """Download the swarm's state when behind (see :meth:`StateCatchUp.catch_up`)."""
        return self.state.catch_up(swarm_epoch, epoch=epoch)

    def download(self, min_epoch: int, *, fallback: int) -> int:
        """Download a state of epoch >= ``min_epoch`` now; the epoch reached, or ``fallback``."""
        return self.state.download(min_epoch, fallback=fallback)

    def after_step(self, batch_size: int, loss: torch.Tensor | None) -> None:
        """The bookkeeping ``peer join`` does after each step (metrics, rounds)."""
        hook = self.hook
        if self.metrics is not None:
            self.metrics.maybe_report(
                epoch=hook.epoch, step=self.counts.step, samples=batch_size, loss=loss
            )
        if hook.stats.num_rounds != self.reports.num_rounds_logged:
            self.log_rounds(lambda: None if loss is None else float(loss))

    def log_rounds(self, loss: Callable[[], float | None]) -> None:
        """Add the rounds finished since the last call to the round record (``loss``: the
        recent training loss, asked only when there is news)."""
        self.reports.log_rounds(self.hook.stats, epoch=self.hook.epoch, loss=loss)

    def prometheus_metrics(self) -> PeerMetrics | None:
        """This peer's numbers for a ``/metrics`` scrape (None while it starts); quick, no I/O."""
        hook, services = self.hook, getattr(self, "services", None)
        if hook is None or services is None:
            return None
        record, stats = self.profiler.last_record, hook.stats
        return PeerMetrics(
            epoch=hook.epoch,
            num_steps=self.counts.step,
            num_samples=self.counts.total_samples,
            samples_per_s=record.samples_per_s if record is not None else 0.0,
            phase_s=self.profiler.clock.snapshot().seconds,
            sent_bytes=services.transport.counters.sent,
            recv_bytes=services.transport.counters.recv,
            num_rounds=stats.num_rounds,
            num_failed_rounds=stats.num_failed_rounds,
            num_swarm_peers=services.tracker.current().num_peers,
            loss=record.loss if record is not None else None,
            deadlines_s=services.averager.deadlines.snapshot(),
        )

    def _on_epoch(self, epoch: int) -> None:
        """At every epoch change (a round, a catch-up, a jump; :class:`Epoch` calls it)."""
        self.profiler.on_epoch(epoch)
        self.reports.set_epoch(epoch)
        self._on_epoch_user(epoch)

    def _serve_state(self, epoch: int) -> None:
        """Once the state of an epoch is whole (every round before it applied: at its start,
        or when a round in the background lands): served, and its digest announced."""
        self.services.state_server.update(self.state.snapshot(epoch))

    # ---- leaving -------------------------------------------------------------------------

    def close(self, *, last_loss: torch.Tensor | None, summary: bool, timeout_s: float) -> None:
        """Apply a round in flight, write the last metrics line, print the table (``summary``),
        stop publishing and leave the run; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        hook = self.hook
        try:
            if hook is not None:
                hook.flush()
                self.log_rounds(lambda: None if last_loss is None else float(last_loss))
                if self.metrics is not None:
                    self.metrics.report(epoch=hook.epoch, step=self.counts.step, loss=last_loss)
                self.profiler.stop_publishing(timeout_s=max(timeout_s, 1.0))
                if summary:
                    self.profiler.print_summary()
        finally:
            self._leave(max(timeout_s, 1.0))

    def leave(self, *, timeout_s: float) -> None:
        """Stop publishing and leave the run, without :meth:`close`'s last words (``peer
        join`` says them itself); safe to call twice."""
        self._closed = True
        self._leave(timeout_s)

    def _leave(self, timeout_s: float) -> None:
        if self._left:
            return
        self._left = True
        if self.dht.serves_metrics:
            self.dht.attach_metrics(None)
        self.profiler.close(timeout_s=timeout_s)
        self.reports.close(self.loop_thread, timeout_s=timeout_s)
        try:
            self.loop_thread.run(self.services.close(), timeout_s=timeout_s)
        finally:
            if self.metrics is not None:
                self.metrics.close()


class _CatchUp:
    """The collaborative optimizer's :class:`peer.swarm.round.StateSource` for a library peer:
    the optimizer's own catch-up (which notes, for its scheduler, that the LR came along)."""

    def __init__(self, on_behind: Callable[[int], int]):
        self._on_behind = on_behind

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        return self._on_behind(swarm_epoch)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
