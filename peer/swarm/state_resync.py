"""Replicas that disagree re-sync: a peer whose state differs from the one its swarm agrees on
downloads that state instead of stepping on apart (issue 29, item 4).

What peers agree on, by mode (the digest's scope, :mod:`peer.swarm.catch_up`): in ``grad`` mode
the model and the optimizer (every member of a full round applies the same averaged gradient to
the same replica); in ``params`` mode the model (every member of a full round takes the same
average); in ``diloco`` the model and the outer optimizer's momentum (every member applies the
same averaged pseudo-gradient to the same replica with the same momentum; the momentum is served
with the model). So the digests honest peers announce for an epoch are equal bit for bit, and
one that differs stays apart (for good in ``grad`` and ``diloco``: a round that failed and
stepped alone, a group split, one level of a reduce lost; in ``params`` until its next full
round). :class:`ReplicaCheck` runs on the event loop: after this peer's digest of an epoch is
announced, it reads the announcements (:mod:`peer.records.state`) and asks
:func:`peer.records.state.resync_target` whether another digest of that epoch beats its own
(more peers, or as many and a smaller peer id, and never a stranger's alone). If so on two
decisions in a row (a read apart, on later and later epochs), the training thread downloads that
state between two steps from the peers that announce it
(:meth:`peer.swarm.catch_up.StateCatchUp.resync`: exact, with every check of a download),
waiting up to ``RESYNC_WAIT_S`` for them to serve the state of its epoch.

Bounded: at most one re-sync per ``resync_min_epochs`` epochs, twice as many after each re-sync
that loaded a state, until an epoch after it agrees again (up to ``resync_max_epochs``); one
that loaded nothing (its donors did not serve its epoch in time) doubles nothing, and the
replica is decided anew. A decision never rests on a digest of the replica a re-sync, or any
other download (:meth:`ReplicaCheck.replaced`), replaced.
A read of the announcements at most every ``resync_check_s`` and only when this peer announced
a new epoch (a few reads, when nobody else announces it), none while a re-sync would not be
allowed. Each re-sync is counted and logged as one WARNING line.

With rounds overlapped (``delay_update``, ``diloco_overlap``) the digest of an epoch is of the
state after the round in flight as it began (:class:`peer.swarm.epoch.Epoch`), on every peer
alike; a re-syncing peer applies its own round in flight, then the download replaces it.

A peer that downloaded its state as bfloat16 (``--state-compression bf16``) holds a replica
rounded away from everyone's: it differs, and re-syncs once, exactly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Protocol

from dht.errors import DHTError
from dht.kademlia.node import DHTNode
from peer.records.state import ResyncTarget, resync_target
from peer.swarm.state_agreement import Reach, read_announcements
from peer.swarm.state_sync import REREAD_WINDOW_S, StateServer
from peer.swarm.state_sync_config import StateSyncConfig

logger = logging.getLogger(__name__)
# Reads of an epoch's announcements while nobody else has announced it, before it is let go.
MAX_READS_PER_EPOCH = 3
# Decisions in a row (each on a later epoch, a read apart) that this replica lost, before it is
# re-synced: one read can catch a peer that is re-syncing itself between its old digest and its
# new one (its old one would win a tie), or before everyone announced the epoch.
NUM_CONFIRMATIONS = 2
# The longest the check waits after failures, in check intervals.
MAX_BACKOFF = 64
# How long a re-sync waits for its donors to serve the state of this peer's epoch, in seconds:
# a donor serves an epoch's state once its digest is announced (MIN_ANNOUNCE_GAP_S after the
# previous announcement, plus the digest's time), and with epochs shorter than that its newest
# served state trails the epoch this peer re-syncs at. Its round of that epoch waits meanwhile
# for this peer, whose record says it is there.
RESYNC_WAIT_S = REREAD_WINDOW_S


class Resyncer(Protocol):
    """What the collaborative optimizer asks between steps (:mod:`peer.swarm.catch_up`)."""

    def resync_due(self) -> bool:
        """Whether this peer's replica should be replaced now (cheap: no I/O)."""
        ...

    def resync(self, epoch: int) -> int | None:
        """Download the agreed state of ``epoch`` or later; the epoch loaded, or None."""
        ...


class ReplicaCheck:
    """Decides, on the event loop, whether this peer's replica should be re-synced.

    Args:
        dht: the node that reads the announcements.
        prefix: the run's key prefix.
        server: this peer's state server (its digests, and what it has announced).
        partners: the peers this one averaged with lately (read on the event loop).
        config: the re-sync's bounds and the check's interval.
    """

    def __init__(
        self,
        *,
        dht: DHTNode,
        prefix: str,
        server: StateServer,
        partners: Callable[[], frozenset[str]],
        config: StateSyncConfig,
    ):
        self.dht = dht
        self.prefix = prefix
        self.server = server
        self.partners = partners
        self.config = config
        self._lock = threading.Lock()
        self._target: ResyncTarget | None = None
        self._settled_epoch = -1  # the newest epoch decided
        self._num_lost = 0  # decisions in a row that another digest beat this replica's
        self._reads: dict[int, int] = {}  # epoch -> reads that found nobody else there
        self._gap_epochs = config.resync_min_epochs
        self._next_allowed_epoch = 0
        self._resyncing = False  # between take() and resynced()
        self.num_reads = 0
        self.num_failures = 0  # checks that raised (a bug), logged once
        self._task: asyncio.Task | None = None

    # ---- the training thread's side ----------------------------------------------------------

    def due(self) -> bool:
        return self._target is not None

    def take(self) -> ResyncTarget | None:
        """The target to re-sync to now, cleared (say how it went with :meth:`resynced`; no
        decision is made until then: the digests read meanwhile are the replaced replica's)."""
        with self._lock:
            target, self._target = self._target, None
            self._resyncing = self._resyncing or target is not None
            return target

    def resynced(self, epoch: int, reached: int | None) -> None:
        """The re-sync taken at ``epoch`` loaded the state of ``reached`` (None: nothing).

        Loaded: the next re-sync waits ``_gap_epochs`` epochs, and the gap doubles until an
        epoch after ``reached`` agrees again; the epochs up to ``reached`` are decided (this
        replica's digests before it are the old replica's, and ``reached``'s is the donor's
        own). Nothing loaded (no donor had the state in time): no re-sync happened, so nothing
        doubles; the replica is decided anew from the next epoch on."""
        with self._lock:
            self._resyncing = False
            self._target = None
            self._num_lost = 0
            if reached is None:
                self._next_allowed_epoch = epoch + 1
                return
            self._next_allowed_epoch = reached + self._gap_epochs
            self._gap_epochs = min(2 * self._gap_epochs, self.config.resync_max_epochs)
            self._settled_epoch = max(self._settled_epoch, reached)

    def replaced(self, reached: int) -> None:
        """A download outside a re-sync (catching up with the swarm, a load the user asked
        for) replaced this replica by the agreed state of ``reached``: the digests announced
        before it are the old replica's, so no decision rests on them, and a target they set
        is dropped. 32 ``peer join`` peers: a row whose top round failed caught up to epoch
        21, then re-synced at once on its old digest of epoch 18, and the second download put
        it at epoch 22, ahead of the swarm's records, where three of its peers formed a group
        of their own and ran apart for the rest of the run."""
        with self._lock:
            self._target = None
            self._num_lost = 0
            self._settle(reached)

    # ---- the event loop's side ---------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="replica-check")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = 1
        while True:
            await asyncio.sleep(self.config.resync_check_s * backoff)
            try:
                await self.check()
                backoff = 1
            except DHTError as e:  # the next check reads again
                logger.debug("replica check: %s", str(e) or type(e).__name__)
            except Exception:  # a bug: said once, counted, and the check goes on, slower
                self.num_failures += 1
                if self.num_failures == 1:
                    logger.exception("the replica check failed; it goes on with backoff")
                backoff = min(2 * backoff, MAX_BACKOFF)

    async def check(self) -> ResyncTarget | None:
        """One look: the target set (None when the replica stands or nothing is known yet).

        It decides on this peer's newest announced epoch that others announced too (with
        epochs shorter than the check's interval, the newest may not be announced by others
        yet, and the one before it is)."""
        served = self.server.served
        announced = served.epoch if served is not None else -1
        own = [d for d in list(self.server.digests) if d.epoch <= announced]
        if not own or own[-1].epoch <= self._settled_epoch:
            return None  # nothing new announced since the last decision
        if own[-1].epoch < self._next_allowed_epoch or self._resyncing:
            return None  # a re-sync would not be allowed (or is under way): no read
        self.num_reads += 1
        reach = Reach(self.server.num_peers(), self.partners())
        announcements = await read_announcements(self.dht, self.prefix, reach)
        theirs = {d.epoch for a in announcements for d in a.digests}
        decided = next((d for d in reversed(own) if d.epoch in theirs), None)
        if decided is None or decided.epoch <= self._settled_epoch:
            newest = own[-1].epoch
            self._reads[newest] = self._reads.get(newest, 0) + 1
            if self._reads[newest] >= MAX_READS_PER_EPOCH:
                self._settle(newest)  # nobody else is at this epoch: let it go
            return None
        target = resync_target(
            announcements,
            own=decided,
            own_id=self.dht.peer_id,
            partners=self.partners(),
            min_peers=self.config.min_agreement,
        )
        with self._lock:  # the training thread may have re-synced during the read
            if self._resyncing or decided.epoch <= self._settled_epoch:
                return None  # a digest of the replica it replaced says nothing now
            self._settle(decided.epoch)
            self._num_lost = self._num_lost + 1 if target is not None else 0
            if target is None:
                self._gap_epochs = self.config.resync_min_epochs  # in line again
            elif self._num_lost >= NUM_CONFIRMATIONS:
                self._target = target
        return target

    def _settle(self, epoch: int) -> None:
        self._settled_epoch = max(self._settled_epoch, epoch)
        self._reads = {e: n for e, n in self._reads.items() if e > epoch}
