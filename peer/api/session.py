"""What a library peer runs beside the user's loop, wired as ``peer join`` wires it
(:class:`peer.run.runner.PeerRun`): services on the user's DHT, the collaborative optimizer,
state catch-up and serving, the profiler and its DHT record, the round record, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from peer.api.dht import DHT
from peer.api.swarm import LoopCounts
from peer.profiling.metrics_stream import MetricsStream
from peer.profiling.profiler import Profiler, StepProgress
from peer.run.reports import RunReports
from peer.swarm.averager import SwarmAverager
from peer.swarm.catch_up import StateCatchUp
from peer.swarm.epoch import Epoch
from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.optimizer import CollaborativeConfig, CollaborativeOptimizer, make_contribution
from peer.swarm.progress import GlobalProgress
from peer.swarm.services import open_services

logger = logging.getLogger(__name__)
# Bound on each start and stop call to the network thread, in seconds.
CALL_TIMEOUT_S = 60.0


class Session:
    """One library peer's swarm side; built by :class:`peer.Optimizer`, closed by its
    ``shutdown`` (the DHT stays the user's).

    Args:
        config: the settings (a :class:`peer.api.options.LibraryConfig`).
        dht: the user's running DHT.
        optimizer: the wrapped (inner) optimizer.
        counts: the model of the parameters and the loop's step and sample counts.
        collaborative: the collaborative optimizer's settings.
        on_epoch: called with each new epoch (after the session's own bookkeeping).
        on_behind: ``swarm_epoch -> epoch reached``: the catch-up the collaborative optimizer
            asks for when the swarm is ahead.
        last_loss: ``() -> the last step's loss`` (or None) for the profiler.
        process_name: the trace's process name.
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
        on_behind: Callable[[int], int],
        last_loss: Callable[[], Any],
        process_name: str,
    ):
        self.config, self.dht, self.counts = config, dht, counts
        self.loop_thread = dht.loop_thread
        self.profiler = Profiler(config.profiler_config(), process_name=process_name)
        clock = self.profiler.clock
        contribution = make_contribution(counts.model, optimizer, collaborative)
        self.reports = RunReports(
            peer_id=dht.peer_id,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            publish_interval_s=config.publish_interval,
            metrics=lambda: None,  # no /metrics: the DHT's server was started by the user
        )
        self.metrics: MetricsStream | None = None
        self._closed = False
        self.services = self.loop_thread.run(
            open_services(config, tensors=contribution.buffers, node=dht.node),
            timeout_s=CALL_TIMEOUT_S,
        )
        try:
            self.state = StateCatchUp(
                config,
                trainer=counts,
                optimizer=optimizer,
                services=self.services,
                loop_thread=self.loop_thread,
                clock=clock,
            )
            self.epoch = Epoch(self._initial_epoch())
            self._on_epoch_user = on_epoch
            self.hook = CollaborativeOptimizer(
                model=counts.model,
                optimizer=optimizer,
                averager=SwarmAverager(self.services.averager, self.loop_thread, clock),
                progress=self.services.tracker,
                config=collaborative,
                epoch=self.epoch,
                contribution=contribution,
                lr_schedule=config.lr_schedule_fn(),
                state=_CatchUp(on_behind),
                newcomer_hold=NewcomerHold(config.newcomer_hold_config()),
            )
            self.epoch.subscribe(self._on_epoch)
            epoch = self.epoch.value
            self._start(epoch, last_loss)
        except BaseException:
            self.close(last_loss=None, summary=False, timeout_s=CALL_TIMEOUT_S)
            raise

    def _initial_epoch(self) -> int:
        swarm = self.refresh()
        return self.state.download(swarm.epoch, fallback=0) if swarm.epoch > 0 else 0

    def _start(self, epoch: int, last_loss: Callable[[], Any]) -> None:
        services, config = self.services, self.config
        services.tracker.report_local_progress(epoch, 0)
        if config.wait_for_peers > 1:
            self._wait_for_peers()
        services.state_server.update(self.state.snapshot(epoch))
        if config.metrics_file is not None:
            self.metrics = MetricsStream(
                config.metrics_file,
                peer_id=self.dht.peer_id,
                run_id=config.run_id,
                clock=self.profiler.clock,
                counters=services.transport.counters,
                interval_s=config.metrics_interval,
            )
        self.loop_thread.run(services.state_server.announce(), timeout_s=CALL_TIMEOUT_S)
        self.profiler.attach(
            progress=lambda: StepProgress(self.hook.epoch, self.counts.total_samples, last_loss()),
            counters=services.transport.counters,
            device=str(next(self.counts.model.parameters()).device),
        )
        self.profiler.start_publishing(
            self.loop_thread,
            dht=services.node,
            run_id=config.run_id,
            peer_id=self.dht.peer_id,
            timeout_s=CALL_TIMEOUT_S,
        )
        self.reports.start(self.loop_thread, services.node, epoch=epoch, timeout_s=CALL_TIMEOUT_S)
        services.tracker.report_local_progress(epoch, 0)  # training starts now

    def _wait_for_peers(self) -> None:
        wanted, deadline = (
            self.config.wait_for_peers,
            time.monotonic() + (self.config.wait_for_peers_timeout),
        )
        while self.refresh().num_peers < wanted:
            if time.monotonic() >= deadline:
                logger.warning("only some of %d peers came; training anyway", wanted)
                return
            time.sleep(min(0.2, self.config.publish_interval))

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
            self._log_rounds(loss)

    def _log_rounds(self, loss: torch.Tensor | None) -> None:
        self.reports.log_rounds(
            self.hook.stats,
            epoch=self.hook.epoch,
            loss=lambda: None if loss is None else float(loss),
        )

    def _on_epoch(self, epoch: int) -> None:
        """At every epoch change (a round, a catch-up, a jump; :class:`Epoch` calls it)."""
        self.profiler.on_epoch(epoch)
        # the state at the start of the epoch: served, and its digest announced
        self.services.state_server.update(self.state.snapshot(epoch))
        self.reports.set_epoch(epoch)
        self._on_epoch_user(epoch)

    # ---- leaving -------------------------------------------------------------------------

    def close(self, *, last_loss: torch.Tensor | None, summary: bool, timeout_s: float) -> None:
        """Apply a round in flight, write the last metrics line, print the table (``summary``),
        stop publishing and leave the run; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        hook = getattr(self, "hook", None)
        try:
            if hook is not None:
                hook.flush()
                self._log_rounds(last_loss)
                if self.metrics is not None:
                    self.metrics.report(epoch=hook.epoch, step=self.counts.step, loss=last_loss)
                if summary:
                    self.profiler.print_summary()
        finally:
            self._leave(max(timeout_s, 1.0))

    def _leave(self, timeout_s: float) -> None:
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
