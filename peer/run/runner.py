"""``peer join``: one volunteer's peer, from start to a clean exit.

The training loop runs in the calling (main) thread; the swarm side is the library's: a
:class:`peer.DHT` (its event-loop thread, serving ``/metrics``) and the
:class:`peer.api.session.Session` that :class:`peer.Optimizer` runs, so ``peer join`` and a
library peer cannot drift apart. On start the peer resumes its checkpoint, or downloads the
swarm's state when the swarm is ahead; then it trains with the session's collaborative optimizer
as the trainer's step hook until a stop condition, serving fresh state to newcomers and
checkpointing as it goes. What it shares with the hivemind backend (task, trainer, profiler,
checkpoints, the order of a run) is :class:`peer.run.skeleton.RunSkeleton`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading

from dht.identity import PeerIdentity, short_id
from dht.reach.reachability import Reachability, reachability_line
from dht.runtime import EventLoopThread
from peer.api.dht import DHT
from peer.api.session import Session
from peer.run.config import PeerConfig
from peer.run.reports import RunReports
from peer.run.skeleton import START_TIMEOUT_S, Companion, RunSkeleton
from peer.swarm.catch_up import StateCatchUp
from peer.swarm.epoch import Epoch
from peer.swarm.optimizer import CollaborativeOptimizer
from peer.swarm.round import EpochStats
from peer.swarm.services import SwarmServices
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
        self.dht: DHT | None = None
        self.session: Session | None = None

    # ---- the session's parts, under the names tests and the dashboard use ---------------------

    @property
    def epoch(self) -> int:
        return self.session.epoch.value if self.session is not None else 0

    @property
    def stats(self) -> EpochStats:
        return self.hook.stats

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def address(self) -> str | None:
        return self.dht.address if self.dht is not None else None

    @property
    def loop_thread(self) -> EventLoopThread | None:
        """The DHT's event-loop thread (None before :meth:`start`)."""
        return self.dht.loop_thread if self.dht is not None else None

    @property
    def services(self) -> SwarmServices | None:
        """The session's swarm services (None before :meth:`start`)."""
        return self.session.services if self.session is not None else None

    @property
    def hook(self) -> CollaborativeOptimizer | None:
        """The session's collaborative optimizer, the trainer's step hook."""
        return self.session.hook if self.session is not None else None

    @property
    def reports(self) -> RunReports:
        """The session's round record and ``/metrics`` exporter (after :meth:`start`)."""
        return self.session.reports

    @property
    def state(self) -> StateCatchUp:
        """The session's state catch-up and snapshots (after :meth:`start`)."""
        return self.session.state

    @property
    def epoch_counter(self) -> Epoch | None:
        """The session's :class:`Epoch`, the one owner of the epoch."""
        return self.session.epoch if self.session is not None else None

    @property
    def reachability(self) -> Reachability:
        """What the peer learned at join about how the swarm reaches it."""
        found = self.dht.reachability if self.dht is not None else None
        return found or Reachability(reachable=None, address=self.address, reason="not checked")

    def start(self) -> None:
        """Join the swarm (a :class:`peer.DHT`), then resume or download the state and open the
        swarm side (a :class:`Session`, the library's)."""
        config = self.config
        self.trainer.start_data()  # fork loader workers before the network thread exists
        self.dht = DHT(
            config.initial_peers,
            host=config.host,
            port=config.port,
            announce_host=config.announce_host,
            source_host=config.source_host,
            identity=self.identity,
            swarm_key=config.swarm_key(),
            client_mode=config.client_mode,
            serve_metrics=True,
            relay=config.relay,
            max_relayed_bytes_per_s=config.max_relayed_bytes_per_s,
            relay_via=config.relay_via,
            port_mapping=config.port_mapping,
        )
        logger.info(
            "peer %s joined run %r, serving on %s",
            short_id(self.identity.peer_id),
            config.run_id,
            self.address or "nothing (client mode)",
        )
        logger.info("%s", reachability_line(self.reachability))
        self.session = Session(
            config,
            dht=self.dht,
            optimizer=self.optimizer,
            counts=self.trainer,
            collaborative=self.collaborative_config,
            on_epoch=self._at_boundary,
            last_loss=lambda: self._last_loss,
            profiler=self.profiler,
            start_epoch=self._resume_checkpoint(),
            stop_event=self.stop_event,
        )
        self.trainer.hook = self.session.hook
        self.metrics = self.session.metrics

    def _log_rounds(self) -> None:
        self.session.log_rounds(self._recent_loss)

    def _on_step(self, report: StepReport) -> None:
        self._note_step(report)
        if self.hook.stats.num_rounds != self.reports.num_rounds_logged:
            self._log_rounds()

    def _before_training(self) -> None:
        # training starts now: joining and waiting are no part of this peer's rate
        self.services.tracker.report_local_progress(self.epoch, 0)

    def _after_training(self) -> None:
        self.hook.flush()  # a delayed update still in flight
        self._log_rounds()
        self.profiler.stop_publishing(timeout_s=START_TIMEOUT_S)

    def close(self) -> None:
        """Leave the swarm and stop the loop thread; safe to call twice."""
        self.profiler.close()  # stops publishing before the DHT node closes
        try:
            if self.session is not None:
                self.session.leave(timeout_s=START_TIMEOUT_S)
        finally:
            if self.dht is not None:
                self.dht.shutdown()
            self.trainer.close()
