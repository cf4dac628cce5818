"""The hivemind backend of ``peer join``: our task, trainer and profiler on hivemind's stack.

hivemind.DHT (with its libp2p daemon, p2pd) replaces our DHT and transport, and hivemind.Optimizer
replaces the collaborative optimizer: it is the trainer's :class:`peer.train.trainer.StepHook`,
called
after every backward pass with the local step's gradients. Everything else is shared with the
native backend: the task, the :class:`Trainer` loop, the :class:`PhaseClock`, the metrics
stream and the summary fields. hivemind is imported lazily (``import_hivemind``), so nothing else
needs the ``[hivemind]`` extra.

How hivemind's time is attributed (hivemind 1.1.12, pinned by the extra): ``Optimizer.step``
either only accumulates the gradients (charged to ``optimizer``, as a local step is) or, once the
swarm has the target batch, finishes the epoch. Its wait for the gradient round
(``_average_gradients_and_load_into_optimizer``) is charged to ``matchmaking`` until the round's
``StepControl`` says the all-reduce began (polled every millisecond from a helper thread), and to
``allreduce`` from then to the end of the wait; the optimizer update after it stays in
``optimizer``. hivemind's pre-scheduled matchmaking runs in its averager process while this peer
computes, so only the part of it that the training thread waits for shows. In ``params`` mode the
parameter round runs synchronously inside the epoch transition, which is charged to
``matchmaking`` as a whole (hivemind reports no split). State downloads
(``load_state_from_peers``, which hivemind calls inside ``step`` when the peer is behind) are
charged to ``state_sync``. Byte counts are estimates: hivemind does not expose what p2pd sent, so
the metrics stream's ``net`` counts the butterfly all-reduce's payload per round,
2 (n-1)/n of the compressed gradients each way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from typing import Any

from averaging.result import RoundResult
from dht.errors import ConfigError
from peer.hivemind.hook import (
    EstimatedCounters,
    HivemindBootstrap,
    HivemindHook,
    children_take_sigterm,
    hivemind_compression,
    import_hivemind,
    listen_maddrs,
    swarm_peer_id,
    wait_for_peers,
)
from peer.hivemind.records import HivemindRecordPublisher, LocalProgress
from peer.profiling.profiler import StepProgress
from peer.run.config import PeerConfig
from peer.run.skeleton import Companion, RunSkeleton
from peer.swarm.round import EpochStats, round_entry
from peer.train.trainer import StepReport

__all__ = ["HivemindBootstrap", "HivemindPeerRun", "check_config", "listen_maddrs"]

logger = logging.getLogger(__name__)


def check_config(config: PeerConfig) -> None:
    """Refuse, before anything starts, the options that have no hivemind equivalent.

    Raises:
        ConfigError: one line naming the option.
    """
    if config.mode == "diloco":
        raise ConfigError("--mode diloco: hivemind.Optimizer has no DiLoCo mode; use grad/params")
    if config.swarm_key_file is not None:
        raise ConfigError("--swarm-key-file: the hivemind backend has no swarm key (use native)")
    if config.identity is not None:
        raise ConfigError("--identity is a native Ed25519 key; hivemind keeps its own identity")
    if config.source_host is not None:
        raise ConfigError("--source-host: libp2p picks its own source address (use native)")
    if config.optimizer not in ("adam", "sgd"):
        raise ConfigError(f"--optimizer: {config.optimizer!r} is not adam or sgd")
    for address in config.initial_peers:
        if not address.startswith("/"):
            raise ConfigError(f"--initial-peers: {address!r} is not a libp2p multiaddr (/ip4/...)")


class HivemindPeerRun(RunSkeleton):
    """One peer's run on hivemind; :meth:`run` blocks until it stops (like ``PeerRun``).

    Besides hivemind's own progress record, the peer publishes its profile and round records
    (:mod:`peer.hivemind.records`), so the dashboard shows a hivemind swarm as it shows ours.

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
        check_config(config)
        import_hivemind()
        super().__init__(
            config,
            process_name="peer (hivemind)",
            data_seed=config.seed if config.seed is not None else _random_seed(),
            stop_event=stop_event,
            companion=companion,
        )
        if self.trainer.amp.scaler is not None:
            raise ConfigError("--amp fp16 needs hivemind's own GradScaler; use bf16 or off")
        self.counters = EstimatedCounters()
        self.dht: Any = None
        self.opt: Any = None
        self.hook: HivemindHook | None = None
        self.records: HivemindRecordPublisher | None = None
        self._profiled_epoch = 0

    @property
    def epoch(self) -> int:
        return self.hook.epoch if self.hook is not None else self._profiled_epoch

    @property
    def stats(self) -> EpochStats:
        return self.hook.stats

    @property
    def address(self) -> str | None:
        if self.dht is None:
            return None
        maddrs = self.dht.get_visible_maddrs()
        return str(maddrs[0]) if maddrs else None

    def start(self) -> None:
        """Start hivemind.DHT and hivemind.Optimizer, resume a checkpoint, wait for peers."""
        hivemind = import_hivemind()
        config = self.config
        _quiet_hivemind()
        children_take_sigterm()
        self.trainer.start_data()  # fork loader workers before hivemind's processes and threads
        with self.clock.phase("other"):
            self.dht = hivemind.DHT(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=listen_maddrs(config.host, config.port),
                announce_maddrs=(
                    listen_maddrs(config.announce_host, config.port)
                    if config.announce_host
                    else None
                ),
                client_mode=config.client_mode,
                start=True,
            )
        epoch = self._resume()
        self.opt = hivemind.Optimizer(
            dht=self.dht,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            batch_size_per_step=self.task.batch_size,
            optimizer=self.trainer.optimizer,
            matchmaking_time=config.matchmaking_time,
            averaging_timeout=config.averaging_timeout,
            use_local_updates=config.mode == "params",
            delay_state_averaging=config.mode != "params",
            grad_compression=hivemind_compression(config.compression),
            state_averaging_compression=hivemind_compression(config.compression),
            averager_opts={
                "target_group_size": config.target_group_size,
                "min_group_size": min(config.min_group_size, config.target_group_size),
            },
            client_mode=config.client_mode,
            verbose=False,
        )
        self.opt.state_averager.local_epoch = epoch
        self.records = HivemindRecordPublisher(
            self.dht,
            run_id=config.run_id,
            libp2p_id=self.dht.peer_id.to_bytes(),
            make_profile=lambda time_s: self.profiler.make_record(
                peer_id=self.swarm_peer_id, time_s=time_s
            ),
            progress=self._local_progress,
            target_batch_size=config.target_batch_size,
            address=self.address,
            client_mode=config.client_mode,
            interval_s=config.publish_interval,
            profile_interval_s=config.profile_interval,
        )
        self.hook = HivemindHook(
            self.opt,
            self.clock,
            compression=config.compression,
            counters=self.counters,
            on_round=self._on_round,
            leave=self.stop_event,
        )
        self.trainer.hook = self.hook
        logger.info(
            "hivemind peer %s (dashboard id %s) joined run %r on %s",
            *(self.peer_id, self.swarm_peer_id[:8], config.run_id, self.address),
        )
        if getattr(config, "wait_for_peers", 1) > 1:
            wait_for_peers(
                self.dht,
                f"{config.run_id}_vp_joined",
                peer_id=self.peer_id,
                wanted=config.wait_for_peers,
                timeout_s=config.wait_for_peers_timeout,
                stop_event=self.stop_event,
            )
        self._profiled_epoch = epoch
        self.profiler.attach(
            progress=lambda: StepProgress(self.epoch, self.trainer.total_samples, self._last_loss),
            counters=self.counters,
            device=str(self.trainer.device),
        )
        self.records.start()
        self._open_metrics(self.peer_id, self.counters)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58() if self.dht is not None else "?"

    @property
    def swarm_peer_id(self) -> str:
        """This peer's name in the dashboard's records (:func:`swarm_peer_id`)."""
        return swarm_peer_id(self.dht.peer_id) if self.dht is not None else "?"

    def _local_progress(self) -> LocalProgress:
        """Where this peer is, for its progress record (read from the publisher's thread)."""
        opt, stats = self.opt, self.hook.stats
        round_s = stats.matchmaking_s + stats.allreduce_s
        if opt is None:  # leaving
            return LocalProgress(self._profiled_epoch, 0, self.trainer.total_samples, round_s)
        tracked = opt.tracker.local_progress  # hivemind replaces it whole: a consistent read
        samples = tracked.samples_accumulated if tracked.epoch == opt.local_epoch else 0
        return LocalProgress(opt.local_epoch, samples, self.trainer.total_samples, round_s)

    def _on_round(self, result: RoundResult, group_size: int) -> None:
        loss = self._recent_loss()
        entry = round_entry(
            result, epoch=result.epoch, loss=loss if math.isfinite(loss or 0.0) else None
        )
        self.records.add_round(dataclasses.replace(entry, group_size=group_size))

    def _after_training(self) -> None:
        if self.records is not None:
            self.records.stop_profiles()

    def _resume(self) -> int:
        return self._resume_checkpoint()

    def _on_step(self, report: StepReport) -> None:
        self._note_step(report)
        if self.hook.epoch != self._profiled_epoch:
            self._profiled_epoch = self.hook.epoch
            self.profiler.on_epoch(self.hook.epoch)
        self._at_boundary(self.hook.epoch)

    def close(self) -> None:
        """Leave the swarm (hivemind's goodbye), stop its processes; safe to call twice."""
        self.profiler.close()
        records, self.records = self.records, None
        if records is not None:
            records.close()
        opt, self.opt = self.opt, None
        if opt is not None:
            # hivemind 1.1.12's shutdown cancels a round still looking for a group, and raises
            # InvalidStateError (skipping the rest of its shutdown) when the hook already
            # cancelled it because the peer was leaving: a finished round needs nothing.
            for name in ("scheduled_grads", "scheduled_state"):
                control = getattr(opt, name, None)
                if control is not None and control.done():
                    setattr(opt, name, None)
            opt.shutdown()
        dht, self.dht = self.dht, None
        if dht is not None:
            dht.shutdown()
        if self.metrics is not None:
            self.metrics.close()
        self.trainer.close()


def _random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _quiet_hivemind() -> None:
    """hivemind logs through its own handler at INFO; follow our root logger's level instead."""
    logging.getLogger("hivemind").setLevel(
        max(logging.getLogger().getEffectiveLevel(), logging.INFO)
    )
