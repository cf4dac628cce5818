"""State sync: peers serve their state of the epoch; a newcomer or a laggard downloads it.

The state is the model's parameters and buffers, the optimizer's tensors and msgpack metadata
(epoch, optimizer and scheduler scalars), sent as raw little-endian tensor bytes (float32 ones
as bfloat16 when the downloader asks: :mod:`peer.swarm.state_sync_config`) behind a msgpack
header over one transport stream: nothing is unpickled. A peer hands its server a snapshot at the
start of every epoch; the server computes the snapshot's digests (:mod:`peer.swarm.state_digest`)
on a worker thread of its own, for the epochs
:mod:`peer.swarm.digest_schedule` picks (every epoch unless hashing is costly next to an epoch),
and announces ``{epoch, address, digests of its last epochs}`` under its own
(signed) subkey of ``{prefix}/state`` (:mod:`peer.records.state`) right away (at most every
``MIN_ANNOUNCE_GAP_S``) and every ``announce_interval_s``. The downloader's side, which accepts a
state only when enough peers announce its digest, is :mod:`peer.swarm.state_download`.

A downloader asks its donors to digest now (the ``state.digest_now`` request): each digests its
newest snapshot at once and every epoch for ``EAGER_S`` after, so that the newest state is agreed
within an announcement gap, not a schedule's stride later. What one request can cost a donor is
what the schedule saves (hashing every epoch, the stride-1 cost), for ``EAGER_S``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dht.kademlia.node import DHTNode
from dht.net.shares import OverShare
from dht.net.transport import IncomingStream, Transport
from dht.owned_record import OwnedRecord
from peer.records.state import MAX_DIGESTS, EpochDigest, StateAnnouncement, announcement_key
from peer.swarm.digest_schedule import LINGER_S, DigestSchedule
from peer.swarm.state_digest import state_digest
from peer.swarm.state_serve import ServeLimits, parse_request, serve_snapshot
from peer.swarm.state_sync_config import StateSyncConfig

logger = logging.getLogger(__name__)
STREAM_NAME = "state.get"
DIGEST_NOW_NAME = "state.digest_now"
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


# A donor announces at once when its state changes, but not more often than this, in seconds.
MIN_ANNOUNCE_GAP_S = 0.5
# How long a downloader keeps reading the announcements for a state's digest (0.5, 1 and 2 s
# apart, see peer.swarm.state_download), with the announcement gap on top.
REREAD_WINDOW_S = 4.0
# Snapshots waiting for their digest at most (a state copy each; the oldest is dropped).
PENDING_DIGESTS = 4
# After a request to digest now, a donor digests every epoch for this long, in seconds: a
# download's reads of the agreement (REREAD_WINDOW_S) and the download itself (a downloader
# asks again before each pass over its donors).
EAGER_S = 10.0


class StateSyncError(Exception):
    """No donor could provide a complete state (or a state failed a check)."""


class StateRejected(StateSyncError):
    """A downloaded state failed a check (digest, values, metadata); the next donor is tried."""


@dataclass(frozen=True)
class StateSnapshot:
    """An immutable copy of a peer's state at one epoch (tensors contiguous, on the CPU)."""

    epoch: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, epoch: int, tensors: dict[str, torch.Tensor], metadata=None):
        """Copy ``tensors`` (call from the thread that owns them, between steps)."""
        copies = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        return cls(epoch, copies, dict(metadata or {}))


# (snapshot, bf16) -> hex digest: what a server announces of each snapshot
DigestFn = Callable[[StateSnapshot, bool], str]


def default_digest(snapshot: StateSnapshot, bf16: bool) -> str:
    """The digest of every tensor of ``snapshot`` (no optimizer structure)."""
    return state_digest(snapshot.epoch, snapshot.tensors, bf16=bf16)


class StateServer:
    """Serves the snapshot of this peer's epoch on the transport and announces its digests.

    Args:
        transport: not yet started (the stream handler is added here).
        dht: the node to announce on (its transport is ``transport``).
        prefix: the run's key prefix.
        config: intervals and sizes.
        digest: how a snapshot's digest is computed (:attr:`digest_fn`, which the peer may set
            before the first snapshot: the scope and optimizer structure are the run's).
    """

    def __init__(
        self,
        *,
        transport: Transport,
        dht: DHTNode,
        prefix: str,
        config: StateSyncConfig,
        digest: DigestFn = default_digest,
    ):
        self.dht = dht
        self.prefix = prefix
        # the swarm's size as this peer counts it (set by its owner; read on the event loop):
        # it picks the announcement's bucket
        self.num_peers: Callable[[], float] = lambda: 1.0
        self.config = config
        self.digest_fn = digest
        self.snapshot: StateSnapshot | None = None  # the newest handed over
        # the newest snapshot whose digest has been announced: what is served instead of the
        # newest when epochs outrun announcements (see _newest_verifiable)
        self.served: StateSnapshot | None = None
        self._update_times: collections.deque[float] = collections.deque(maxlen=MAX_DIGESTS)
        self._digested: StateSnapshot | None = None
        self.digests: collections.deque[EpochDigest] = collections.deque(maxlen=MAX_DIGESTS)
        # snapshots handed over and not digested yet, oldest first: every epoch gets its digest
        # (peers agree on epochs they all digested) unless epochs outrun hashing by this many
        self._pending: collections.deque[StateSnapshot] = collections.deque(maxlen=PENDING_DIGESTS)
        self._digest_task: asyncio.Task | None = None
        self._handed = asyncio.Event()  # set when a snapshot is queued for its digest
        self._digesting: StateSnapshot | None = None
        self._schedule = DigestSchedule(
            max_stride=config.max_digest_stride, max_gap_s=config.max_digest_gap_s
        )
        self._linger: asyncio.TimerHandle | None = None
        self._eager_until = -math.inf  # loop time until which every epoch is digested
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last_announce = -math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        # The periodic announcement and the one after a digest may coincide: OwnedRecord sends
        # one at a time, each dated after the last, or replicas would refuse the older as stale.
        self._announcer = OwnedRecord(
            dht=dht,
            key=lambda: announcement_key(self.prefix, self.dht.peer_id, self.num_peers()),
            make_value=self._announcement,
            ttl_s=config.record_ttl_s,
            interval_s=config.announce_interval_s,
            name="state announcement",
        )
        self.limits = ServeLimits(
            max_streams=config.max_streams,
            max_streams_per_peer=config.max_streams_per_peer,
            max_streams_per_address=config.max_streams_per_address,
            max_old_snapshots=config.max_old_snapshots,
            serve_timeout_s=config.serve_timeout_s,
        )
        transport.add_stream_handler(STREAM_NAME, self._serve)
        transport.add_rpc_handler(DIGEST_NOW_NAME, self._on_digest_now)

    def update(self, snapshot: StateSnapshot) -> None:
        """Digest ``snapshot`` (this peer's state at the start of its epoch) and serve it once
        its digest is announced; call from the training thread at every epoch change."""
        self.snapshot = snapshot
        handed_s = time.monotonic()
        self._update_times.append(handed_s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_digesting, snapshot, handed_s)

    def _newest_verifiable(self) -> bool:
        """Whether a downloader can check the newest snapshot: its digest is announced within
        ``MIN_ANNOUNCE_GAP_S`` and stays among the last ``MAX_DIGESTS`` announced while the
        downloader reads the announcements again (for ``REREAD_WINDOW_S``), unless epochs come
        so fast that the window turns over first; then the newest announced one is served."""
        times = self._update_times
        return len(times) < MAX_DIGESTS or times[-1] - times[0] > REREAD_WINDOW_S

    def _start_digesting(self, snapshot: StateSnapshot, handed_s: float) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        wanted = self._schedule.wants(snapshot.epoch, handed_s)  # asked always: it times epochs
        if wanted or asyncio.get_running_loop().time() < self._eager_until:
            # a request to digest now may have queued it, or a newer one, first (digests and
            # announcements go newest last)
            newest = self.snapshot or snapshot
            if not self._will_announce(snapshot) and not self._will_announce(newest):
                self._queue(snapshot)
        else:  # digested if still the newest a while later
            self._linger = asyncio.get_running_loop().call_later(
                LINGER_S, self._linger_over, snapshot
            )
        self.limits.moved_on(self._current_ids())

    def _linger_over(self, snapshot: StateSnapshot) -> None:
        self._linger = None
        if snapshot is self.snapshot and not self._will_announce(snapshot):
            self._queue(snapshot)

    async def _on_digest_now(self, ctx, request: Any) -> dict[str, Any]:
        """A downloader's ``state.digest_now``: digest the newest snapshot now and every epoch
        for ``EAGER_S``; answered with the newest snapshot's epoch (None before the first)."""
        self._eager_until = asyncio.get_running_loop().time() + EAGER_S
        snapshot = self.snapshot
        if snapshot is None or self._loop is None:
            return {"epoch": None}
        if not self._will_announce(snapshot):
            self._queue(snapshot)
        return {"epoch": snapshot.epoch}

    def _will_announce(self, snapshot: StateSnapshot) -> bool:
        """Whether ``snapshot``'s digest is announced, or about to be."""
        return (
            snapshot is self._digested
            or snapshot is self._digesting
            or any(snapshot is s for s in self._pending)
        )

    def _queue(self, snapshot: StateSnapshot) -> None:
        self._pending.append(snapshot)
        self._handed.set()
        if self._digest_task is None or self._digest_task.done():
            self._digest_task = asyncio.create_task(
                self._digest_and_announce(), name="state-digest"
            )

    async def _digest_and_announce(self) -> None:
        # A snapshot queued while the announcement is on its way finds this task running and
        # starts none: it is digested here, or it waited for an epoch that might never come.
        while await self._digest_pending():
            await self.announce()
            if not self._pending:
                return

    async def _digest_pending(self) -> bool:
        """Digest every queued snapshot, and those queued until ``MIN_ANNOUNCE_GAP_S`` after
        the last announcement; whether there is something new to announce."""
        loop = asyncio.get_running_loop()
        while True:
            while self._pending:
                snapshot = self._digesting = self._pending.popleft()
                try:
                    exact, rounded, cost_s = await loop.run_in_executor(
                        self._digest_executor(), self._digests_of, snapshot
                    )
                except Exception:  # a bug, not a peer's fault: say so, keep serving
                    logger.exception("cannot digest the state of epoch %d", snapshot.epoch)
                    return False
                finally:
                    self._digesting = None
                self._schedule.measured(cost_s)
                if self.digests and self.digests[-1].epoch == snapshot.epoch:
                    self.digests.pop()  # a new snapshot of the same epoch (a download, a resume)
                self.digests.append(EpochDigest(snapshot.epoch, exact, rounded))
                self._digested = snapshot
            wait_s = self._last_announce + MIN_ANNOUNCE_GAP_S - loop.time()
            if wait_s <= 0:
                break
            # Digest what comes meanwhile at once and announce it all after the gap: asleep
            # through it, epochs shorter than a fourth of the gap overflowed the pending queue
            # and their digests were lost.
            self._handed.clear()
            try:
                await asyncio.wait_for(self._handed.wait(), wait_s)
                continue
            except TimeoutError:
                pass
            # nothing came: the periodic announcement (more frequent than the gap) may have
            # published every digest already
            return self.served is not self._digested
        return True

    async def settle(self) -> None:
        """Wait until the last snapshot handed over is digested and announced (at most
        ``MIN_ANNOUNCE_GAP_S`` after the previous announcement), also one the digest schedule
        skipped."""
        await asyncio.sleep(0)  # an update from this thread schedules its digest first
        newest = self.snapshot
        if newest is not None and not self._will_announce(newest):
            self._queue(newest)  # one the schedule skipped
        task = self._digest_task
        if task is not None:
            await asyncio.wait({task})

    def _digest_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="state-digest"
            )
        return self._executor

    def _digests_of(self, snapshot: StateSnapshot) -> tuple[str, str, float]:
        """Both digests of ``snapshot`` and the CPU seconds they took (on the digest thread)."""
        started_s = time.thread_time()
        exact, rounded = self.digest_fn(snapshot, False), self.digest_fn(snapshot, True)
        return exact, rounded, time.thread_time() - started_s

    async def _serve(self, stream: IncomingStream) -> None:
        request = parse_request(stream.header)
        snapshot = self.snapshot
        served = self.served
        fits = served is not None and request is not None and served.epoch >= request.min_epoch
        verifiable = snapshot is not None and self._will_announce(snapshot)
        if fits and not (verifiable and self._newest_verifiable()):
            snapshot = served
        if snapshot is None or request is None or snapshot.epoch < request.min_epoch:
            await stream.reply({"epoch": None})
            return
        if not self._will_announce(snapshot):  # only the newest fits: its digest is due now
            self._queue(snapshot)
        try:
            await serve_snapshot(
                stream, snapshot, request, chunk_bytes=self.config.chunk_bytes, limits=self.limits
            )
        except OverShare as e:  # before anything was sent: the downloader tries another donor
            await stream.reply({"epoch": None, "busy": str(e)})

    def _current_ids(self) -> set[int]:
        """The snapshots the server itself keeps (streams of others are "old")."""
        held = [self.snapshot, self.served, self._digested, self._digesting, *self._pending]
        return {id(s) for s in held if s is not None}

    async def announce(self) -> None:
        """Publish the epoch served, the address and the digests of the last epochs once (with
        no address in client mode: the digests still count for agreement); a failed store is
        a WARNING and the next announcement tries again."""
        await self._announcer.publish()

    def _announcement(self, now: float) -> tuple[dict, float] | None:
        """The record to store at DHT time ``now``; the digested snapshot is served from here on."""
        snapshot = self._digested
        if snapshot is None or not self.digests:
            return None
        if snapshot is not self.served:
            self.served = snapshot
            self.limits.moved_on(self._current_ids())
        self._last_announce = asyncio.get_running_loop().time()
        announcement = StateAnnouncement(
            self.dht.peer_id, snapshot.epoch, self.dht.address, tuple(self.digests)
        )
        return announcement.to_wire(), now

    async def __aenter__(self) -> StateServer:
        self._loop = asyncio.get_running_loop()
        if self.snapshot is not None:  # handed over before the server started
            self._start_digesting(self.snapshot, time.monotonic())
        self._announcer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop digesting and announcing; safe to call twice."""
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        task, self._digest_task = self._digest_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        executor, self._executor = self._executor, None
        if executor is not None:  # a digest under way ends on its own, its result unread
            executor.shutdown(wait=False, cancel_futures=True)
        await self._announcer.close()
