"""A peer's side of state sync: downloading the swarm's state when behind, and the snapshots it
serves to others (:mod:`peer.swarm.state_sync` holds the protocol).

A download is accepted only when its digest (the part of the state the run's mode shares:
:func:`peer.swarm.state_digest.digest_scope`) is one that enough peers announce, its values are
finite and its metadata well typed; the optimizer's hyperparameters stay the local ones
(:mod:`peer.swarm.state_check`). The same digest function labels the snapshots this peer serves.

The training thread calls :meth:`StateCatchUp.download` at start (the swarm is ahead of the
checkpoint) and :meth:`StateCatchUp.catch_up` when the swarm's epoch passes this peer's. A
failed download is retried only after ``RESYNC_COOLDOWN_S`` of training (a donor may be busy),
doubling with each failure in a row up to ``MAX_RESYNC_COOLDOWN_S`` (a peer that no donor can
serve must not ask every donor every 2 s for as long as it is behind); one that worked but
landed behind again (epochs faster than a download) is retried at once, and a lone peer ahead
holds its epoch for this one meanwhile (:mod:`peer.swarm.newcomer_hold`).

It also checks that this peer's replica is the one the swarm agrees on
(:mod:`peer.swarm.state_resync`), and :meth:`StateCatchUp.resync` replaces one that is not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable
from typing import TypeVar

import torch

from dht.errors import DHTError
from dht.runtime import EventLoopThread
from peer.profiling.phases import PhaseClock
from peer.run.config import PeerConfig
from peer.swarm.arrival import FIRST_DOWNLOAD_S, arrives_late, wait_until_left
from peer.swarm.services import SwarmServices
from peer.swarm.state_check import EXTRA_PREFIX, loadable_metadata, parse_header
from peer.swarm.state_digest import (
    OPTIMIZER_PREFIX,
    digest_scope,
    optimizer_structure,
    state_digest,
)
from peer.swarm.state_download import download_state, layout_of
from peer.swarm.state_resync import RESYNC_WAIT_S, ReplicaCheck
from peer.swarm.state_sync import StateRejected, StateSnapshot, StateSyncError
from peer.train.checkpoint import CheckpointError, Progress, pack_state, unpack_state
from peer.train.trainer import Trainer

logger = logging.getLogger(__name__)
# After a failed catch-up download, train on this long before trying again (a donor may be busy).
RESYNC_COOLDOWN_S = 2.0
# The cooldown doubles with each failure in a row, up to this (then one try per this long).
MAX_RESYNC_COOLDOWN_S = 64.0
# How often a download in progress looks whether the peer was told to stop.
STOP_POLL_S = 0.2
# Bound on publishing this peer's record and reading the others' right after a download.
ARRIVAL_REFRESH_TIMEOUT_S = 2.0
T = TypeVar("T")


def retry_cooldown_s(num_failed: int) -> float:
    """The wait before a catch-up download after ``num_failed`` failures in a row: none at
    first, then ``RESYNC_COOLDOWN_S`` doubling per failure, at most ``MAX_RESYNC_COOLDOWN_S``."""
    if num_failed <= 0:
        return 0.0
    return min(MAX_RESYNC_COOLDOWN_S, RESYNC_COOLDOWN_S * 2.0 ** min(num_failed - 1, 32))


class StateCatchUp:
    """Downloads into, and snapshots, one peer's model and optimizer.

    Args:
        config: the peer's settings (run id, state sync settings).
        trainer: the peer's trainer (its model, step and sample counts go into snapshots).
        optimizer: the local optimizer, whose state is synced with the model.
        services: the swarm services (transport, DHT node).
        loop_thread: the event loop the download runs on.
        clock: the phase clock; downloads are charged to ``state_sync``.
        stop_event: when set, a download in progress ends at once (a slow or silent donor
            must not hold a peer that was told to leave for the whole download timeout).
        outer: the outer optimizer (``diloco``): its momentum is part of the replica every
            peer shares, so it is served, covered by the digest and loaded with the model.
    """

    def __init__(
        self,
        config: PeerConfig,
        *,
        trainer: Trainer,
        optimizer: torch.optim.Optimizer,
        services: SwarmServices,
        loop_thread: EventLoopThread,
        clock: PhaseClock,
        stop_event: threading.Event | None = None,
        outer: torch.optim.Optimizer | None = None,
    ):
        self.config = config
        self._stop_event = stop_event or threading.Event()
        self.trainer = trainer
        self.model = trainer.model
        self.optimizer = optimizer
        self.services = services
        self.loop_thread = loop_thread
        self.clock = clock
        self._last_failed_s = -float("inf")
        self._num_failed = 0  # catch-up downloads failed in a row
        self._shares_optimizer = config.mode == "grad"
        self._outer = outer if config.mode == "diloco" else None
        self._scope = digest_scope(config.mode) + ((EXTRA_PREFIX,) if self._outer else ())
        self._meta_key = next(
            iter(pack_state(model=self.model, optimizer=None, progress=Progress())[1])
        )
        services.state_server.digest_fn = self.digest
        self._download_s = FIRST_DOWNLOAD_S  # the last download's time
        # the longest the swarm takes to leave an epoch whose round is starting
        self._round_s = config.matchmaking_time + config.averaging_timeout
        self._overlapped = config.delay_update or config.diloco_overlap
        self.num_resyncs = 0  # re-syncs tried (a replica that differed from the agreed one)
        # in every mode: see peer.swarm.state_resync
        self.replicas: ReplicaCheck | None = ReplicaCheck(
            dht=services.node,
            prefix=config.run_id,
            server=services.state_server,
            partners=lambda: services.tracker.partners,
            config=config.state_sync_config(),
        )
        loop_thread.run(self._start_replica_check())

    async def _start_replica_check(self) -> None:
        self.replicas.start()  # its owner is the services' stack, which closes it first
        self.services.stack.push_async_callback(self.replicas.close)

    def resync_due(self) -> bool:
        """Whether this peer's replica differs from the agreed one (cheap: no I/O)."""
        return self.replicas is not None and self.replicas.due()

    def resync(self, epoch: int) -> int | None:
        """Replace this peer's replica (at ``epoch``) by the agreed state of ``epoch`` or later,
        from the peers that announce it, exactly (no bf16); the epoch loaded, or None. A donor
        that has not served ``epoch`` yet (it announces a moment after entering it) is waited
        for, up to ``RESYNC_WAIT_S``."""
        target = self.replicas.take() if self.replicas is not None else None
        if target is None:
            return None
        self.num_resyncs += 1
        logger.warning(
            "epoch %d: this replica differs from the state %d peer(s) announce for epoch %d "
            "(digest %s); downloading it (re-sync %d)",
            epoch,
            len(target.donors),
            target.epoch,
            target.digest[:12],
            self.num_resyncs,
        )
        reached = self._download(
            epoch, fallback=epoch - 1, donors=target.donors, exact=True, wait_s=RESYNC_WAIT_S
        )
        loaded = reached if reached >= epoch else None
        self.replicas.resynced(epoch, loaded)
        if loaded is not None:
            self.services.state_server.update(self.snapshot(loaded))
        return loaded

    def download(self, min_epoch: int, *, fallback: int) -> int:
        """Load the state of epoch >= ``min_epoch`` from a donor; the epoch reached, or
        ``fallback`` (the model untouched) when no donor delivered."""
        # any agreed state newer than this peer's: a donor serves the newest state it has
        # announced, which can trail the epoch its progress record shows by a moment
        arriving = self._arrival(min_epoch) if min_epoch > fallback else None
        # rounds in the background: the peers at ``arriving`` serve its state once the round
        # before it lands (peer.swarm.epoch); wait a moment for it rather than arrive behind
        overlapped = arriving is not None and self._overlapped
        reached = self._download(
            min(min_epoch, fallback + 1),
            fallback=fallback,
            arriving=arriving,
            wait_s=RESYNC_WAIT_S if overlapped else 0.0,
            wait_for_epoch=arriving if overlapped else None,
        )
        if reached <= fallback:
            self._last_failed_s = time.monotonic()
            self._num_failed += 1
            if arriving is not None:  # it did not arrive: its record says where it is again
                self.services.tracker.report_local_progress(fallback, 0)
        else:  # serve (and vouch for) the state this peer now holds
            self._num_failed = 0
            self.services.state_server.update(self.snapshot(reached))
            if self.replicas is not None:  # its digests before now were of the old replica
                self.replicas.replaced(reached)
            self._announce_arrival(reached)
        return reached

    def _arrival(self, epoch: int) -> int:
        """The epoch to arrive at: ``epoch``, or the next one, once the swarm is there, when the
        round of ``epoch`` would start before the download ends (:mod:`peer.swarm.arrival`)."""
        tracker = self.services.tracker
        if not arrives_late(tracker.current(), epoch, download_s=self._download_s):
            return epoch
        logger.info(
            "epoch %d: its round starts before a download (%.2f s) would end; "
            "arriving at epoch %d instead",
            epoch,
            self._download_s,
            epoch + 1,
        )
        tracker.report_local_progress(epoch + 1, 0, arriving=True)
        self._publish()
        wait_until_left(
            tracker.current, epoch, timeout_s=self._round_s, stop_event=self._stop_event
        )
        return epoch + 1

    def _publish(self) -> None:
        """Publish this peer's record, and read the swarm's, now (bounded)."""
        try:  # publishing and reading warn and go on when the network fails
            self.loop_thread.run(
                self.services.tracker.refresh(), timeout_s=ARRIVAL_REFRESH_TIMEOUT_S
            )
        except DHTError as e:  # the next periodic refresh tries again
            logger.debug("publishing the progress record: %s", e)

    def _announce_arrival(self, epoch: int) -> None:
        """Publish at once that this peer is at ``epoch`` now, and read the swarm anew. With
        epochs shorter than a publishing interval or two, the peers of ``epoch`` would start
        its round before they saw this peer there (a round sized for them alone closes
        without it), and this peer would go by an estimate from before its download."""
        self.services.tracker.report_local_progress(epoch, 0)
        self._publish()

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        """This peer at ``epoch`` is behind the swarm's ``swarm_epoch``: download, unless a
        recent attempt failed; the epoch reached (``epoch`` when nothing was loaded)."""
        if time.monotonic() - self._last_failed_s < self.cooldown_s:
            return epoch  # a recent attempt failed: train on, try again later
        logger.info(
            "the swarm is at epoch %d, this peer at %d: downloading state", swarm_epoch, epoch
        )
        return self.download(swarm_epoch, fallback=epoch)

    @property
    def cooldown_s(self) -> float:
        """Seconds of training after the last failed download before the next try."""
        return retry_cooldown_s(self._num_failed)

    def snapshot(self, epoch: int) -> StateSnapshot:
        """The state to serve now, labelled ``epoch`` (in ``diloco`` the model and the outer
        optimizer's state, under ``extra``: each peer's inner optimizer is its own)."""
        progress = Progress(epoch=epoch, step=self.trainer.step, samples=self.trainer.total_samples)
        if self._outer is not None:
            tensors, metadata = pack_state(
                model=self.model,
                optimizer=None,
                progress=progress,
                extra=self._outer.state_dict(),
            )
        else:
            tensors, metadata = pack_state(
                model=self.model, optimizer=self.optimizer, progress=progress
            )
        return StateSnapshot.capture(epoch, tensors, metadata)

    def digest(self, snapshot: StateSnapshot, bf16: bool) -> str:
        """The digest of ``snapshot`` in this run's scope (the optimizer's structure in
        ``grad`` mode, the outer optimizer's in ``diloco``); :class:`StateRejected` when its
        metadata is malformed."""
        structure = None
        if self._shares_optimizer or self._outer is not None:
            try:
                header = parse_header(snapshot.metadata, self._meta_key)
                if self._outer is not None:  # the outer optimizer's, read as an optimizer's
                    header = {"optimizer": header.get("extra")}
                structure = optimizer_structure(header)
            except (KeyError, TypeError, ValueError, RecursionError) as e:
                raise StateRejected(f"malformed optimizer state: {e}") from None
        return state_digest(
            snapshot.epoch, snapshot.tensors, scope=self._scope, structure=structure, bf16=bf16
        )

    def _loadable(self, snapshot: StateSnapshot) -> dict[str, str]:
        return loadable_metadata(
            snapshot,
            model=self.model,
            optimizer=self.optimizer,
            with_optimizer=self._shares_optimizer,
            outer=self._outer,
        )

    @property
    def _extra_prefix(self) -> str | None:
        """The prefix of the tensors a download takes besides the model's, if any."""
        if self._shares_optimizer:
            return OPTIMIZER_PREFIX
        return EXTRA_PREFIX if self._outer is not None else None

    def _download(
        self,
        min_epoch: int,
        *,
        fallback: int,
        donors: frozenset[str] | None = None,
        exact: bool = False,
        arriving: int | None = None,
        wait_s: float = 0.0,
        wait_for_epoch: int | None = None,
    ) -> int:
        """The epoch loaded, or ``fallback``. ``arriving``: the epoch this peer announces while
        it downloads (see :meth:`_announcing`); None announces nothing. ``wait_s``: how long to
        wait for donors that serve only older states yet (or only states older than
        ``wait_for_epoch``, after which any of ``min_epoch`` or later is taken)."""
        tensors, _ = pack_state(
            model=self.model,
            optimizer=self.optimizer,
            progress=Progress(epoch=0, step=0, samples=0),
        )
        model_layout = {k: v for k, v in layout_of(tensors).items() if k.startswith("model/")}
        model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        config = self.config.state_sync_config()
        if exact:  # a bf16 copy would differ from every donor's digest, and re-sync again
            config = dataclasses.replace(config, compression="none")
        started_s = time.monotonic()
        with self.clock.phase("state_sync"):
            try:
                snapshot = self.loop_thread.run(
                    self._announcing(
                        arriving,
                        download_state(
                            self.services.transport,
                            self.services.node,
                            self.config.run_id,
                            min_epoch=min_epoch,
                            expected=model_layout,
                            config=config,
                            extra_prefix=self._extra_prefix,
                            max_extra_bytes=4 * model_bytes + 2**20,
                            digest_of=self.digest,
                            verify=self._loadable,
                            donors=donors,
                            wait_s=wait_s,
                            num_peers=self.services.tracker.global_progress.num_peers,
                            wait_for_epoch=wait_for_epoch,
                            partners=self.services.tracker.partners,
                        ),
                    )
                )
                progress, extra = unpack_state(
                    snapshot.tensors,
                    self._loadable(snapshot),
                    model=self.model,
                    optimizer=self.optimizer if self._shares_optimizer else None,
                    path="<downloaded state>",
                )
                if self._outer is not None:  # checked by _loadable: its state, our settings
                    self._outer.load_state_dict(extra)
            except (StateSyncError, CheckpointError) as e:
                logger.warning(
                    "could not download the swarm's state (%s); training on from epoch %d",
                    e,
                    fallback,
                )
                return fallback
        self._download_s = time.monotonic() - started_s
        logger.info("downloaded the swarm's state of epoch %d", progress.epoch)
        return progress.epoch

    async def _announcing(self, epoch: int | None, work: Awaitable[T]) -> T:
        """``work`` (a download of the state of ``epoch``), while this peer's record says it is
        at ``epoch`` already. With epochs about as short as a download, the peers there start
        their round before this peer could publish its arrival after the download: a group
        sized for them alone closes without it, it finds the swarm gone, downloads again, and
        the same happens at every epoch (issue 24). Seen during the download, it counts in
        their ``expected_peers``: their group waits for it (the download's time, or once, a
        matchmaking wait when the download fails). The record goes up alongside the download,
        which waits for nothing."""
        if epoch is None:
            return await self._unless_stopped(work)
        tracker = self.services.tracker
        tracker.report_local_progress(epoch, 0, arriving=True)
        publish = asyncio.ensure_future(
            asyncio.wait_for(tracker.refresh(), ARRIVAL_REFRESH_TIMEOUT_S)
        )
        try:
            return await self._unless_stopped(work)
        finally:
            if not publish.done():
                publish.cancel()
            await asyncio.gather(publish, return_exceptions=True)

    async def _unless_stopped(self, work: Awaitable[T]) -> T:
        """``work``, or StateSyncError as soon as the peer is told to stop."""
        task = asyncio.ensure_future(work)
        try:
            while not self._stop_event.is_set():
                done, _ = await asyncio.wait({task}, timeout=STOP_POLL_S)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        raise StateSyncError("the peer is stopping")
