"""Progress over the DHT: peers publish their epoch and samples; each estimates the swarm's.

Every ``publish_interval_s`` a peer stores a signed, expiring record under its own subkey of its
progress bucket, at the two levels its estimate of the swarm's size calls for
(:mod:`peer.records.progress`), then reads a bounded number of buckets back
(:mod:`peer.swarm.progress_sample`: every bucket of a small swarm, a sample of a large one) and
estimates the swarm's epoch, samples toward ``target_batch_size`` and ETA from them
(:mod:`peer.swarm.progress_estimate`, whose docstring says what a record may and may not steer).
A peer's DHT traffic per interval does not grow with the swarm: two stores and at most
``max_buckets_read`` bucket reads of about ``records_per_bucket`` records each, and a layout of
more keys than ``max_keys_read_per_interval`` is read less often
(:func:`peer.swarm.progress_schedule.read_interval_s`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque

from dht.config import get_dht_time
from dht.errors import DHTError
from dht.kademlia.node import DHTNode
from dht.owned_record import OwnedRecord
from dht.periodic import Periodic
from peer.records.progress import PeerProgress, bucket_key, bucket_of, write_levels
from peer.records.progress_read import probe_size
from peer.swarm.progress_config import ProgressConfig
from peer.swarm.progress_estimate import GlobalProgress, Sample, estimate
from peer.swarm.progress_sample import (
    Reprobe,
    SampleRead,
    SizeEstimate,
    plan_read,
    read_sample,
)
from peer.swarm.progress_schedule import (
    Published,
    publish_due,
    read_interval_s,
    record_lifetime_s,
)

__all__ = [
    "GlobalProgress",
    "ProgressConfig",
    "ProgressTracker",
    "Sample",
    "estimate",
    "note_continued",
]

logger = logging.getLogger(__name__)
# How many times this process was continued after a stop (SIGSTOP or Ctrl-Z, then SIGCONT): a
# process-wide fact, which ``peer join`` records from its SIGCONT handler (``note_continued``).
_num_continued = [0]


def note_continued() -> None:
    """Record that this process was just continued after a stop (safe in a signal handler).

    The time it was stopped was not training: the next report of every tracker moves its
    anchor past the stop instead of reading it as a slow stretch. Read as slow training, the
    stop made the other peers undercount this one and overshoot the target, 2-4x per epoch
    in a swarm that the train benchmark pauses this way.
    """
    _num_continued[0] += 1


class ProgressTracker:
    """Publishes this peer's progress and keeps an estimate of the swarm's.

    The training loop calls :meth:`report_local_progress` from its own thread (plain attribute
    writes); the tracker's task on the event loop publishes and reads every
    ``publish_interval_s`` and whenever :meth:`refresh` is awaited.

    Attributes:
        num_keys_read: DHT keys read by the last refresh (at most ``max_buckets_read``, but
            for a newcomer's first, which probes the layout).
        size: the swarm's estimated size (smoothed), None before the first read.
    """

    def __init__(
        self, *, dht: DHTNode, prefix: str, config: ProgressConfig, seed: int | None = None
    ):
        self.dht = dht
        self.prefix = prefix
        self.config = config
        self._samples_per_s = 0.0
        self._rate_time_s = 0.0  # seconds the rate averages over (up to publish_interval_s)
        # (monotonic s, epoch, samples, arriving)
        self._last_report: tuple[float, int, int, bool] | None = None
        self._num_continued = _num_continued[0]  # stops of the process seen by the last report
        self.global_progress = estimate(
            [], own=self._own_record(), config=config, now=get_dht_time()
        )
        self._records: list[PeerProgress] = []
        self._sample: Sample | None = None
        # bumped when the records or the last round's members change (see ``current``)
        self.version = 0
        self._round_peers: dict[str, tuple[int, float]] = {}
        self._round_reach: tuple[int, int] | None = None  # (epoch, peers) of the last round
        self._rounds: deque[frozenset[str]] = deque(maxlen=config.trust_rounds)
        self.partners: frozenset[str] = frozenset()
        self._size = SizeEstimate(config.size_window_s)
        self._rng = random.Random(seed)
        self._num_reads = 0
        self.num_keys_read = 0
        self._last_read_s = -math.inf  # monotonic start of the last read (see read_interval_s)
        self._read_lock = asyncio.Lock()
        self._publish_lock = asyncio.Lock()
        # one owned record per level written (two at a time; a new level, a new record)
        self._owned: dict[int, OwnedRecord] = {}
        self._periodic = Periodic(self._tick, config.publish_interval_s, "progress record")
        self._published: Published | None = None  # the last record every level took
        # the last few refresh cycles (between the starts of two publishes), in s
        self._cycles_s: deque[float] = deque(maxlen=4)
        self._cycle_start_s: float | None = None
        self._reprobe = Reprobe(
            config.publish_interval_s, config.records_per_bucket, time.monotonic()
        )

    @property
    def size(self) -> float | None:
        return self._size.value

    def report_local_progress(self, epoch: int, samples: int, *, arriving: bool = False) -> None:
        """This peer is at ``epoch`` with ``samples`` accumulated toward its target.
        ``arriving``: it announces ``epoch`` ahead of the state download that puts it there.

        Call it at every epoch change and before :meth:`current`; in between, every few local
        steps is enough: the record is dated when its numbers were true, and readers extrapolate
        the samples since.
        """
        now = time.monotonic()
        if self._last_report is not None:
            last_time, last_epoch, last_samples, _ = self._last_report
            # The rate is how fast samples accumulate within an epoch: others extrapolate this
            # peer's count with it. A report across an epoch change spans the round, when
            # nothing accumulates; counting it would make the swarm overshoot every target.
            new_samples = samples - last_samples if epoch == last_epoch else -1
            elapsed_s = now - last_time
            # No new samples: the peer was not training (waiting for peers, downloading), and
            # the rate is how fast it accumulates while it trains; the report moves the anchor.
            # A stop of the process since the last report moves the anchor, leaves the rate.
            stopped = self._num_continued != _num_continued[0]
            if elapsed_s > 0 and new_samples > 0 and not stopped:
                # A moving average over the last publishing interval, and over the time seen
                # so far before that: the rate is right from the second report on. Starting
                # from 0 instead, the first records of a run undercounted every peer, and the
                # swarm's first epochs overshot the target (up to twice it with 2 peers).
                self._rate_time_s = min(
                    self._rate_time_s + elapsed_s, self.config.publish_interval_s
                )
                weight = min(1.0, elapsed_s / self._rate_time_s)
                instant = new_samples / elapsed_s
                self._samples_per_s += weight * (instant - self._samples_per_s)
        # one tuple, swapped at once: the loop thread reads a consistent report
        self._last_report = (now, epoch, samples, arriving)
        self._num_continued = _num_continued[0]

    def _own_record(self) -> PeerProgress:
        report, now = self._last_report, get_dht_time()
        epoch = samples = 0
        arriving = False
        if report is not None:
            reported_s, epoch, samples, arriving = report
            now -= max(0.0, time.monotonic() - reported_s)
        return PeerProgress(
            self.dht.peer_id,
            epoch,
            samples,
            min(self._samples_per_s, self.config.max_samples_per_s),
            now,
            self.dht.address,
            self.dht.address is None,
            arriving,
        )

    async def refresh(self) -> GlobalProgress:
        """Publish the own record, read the buckets and update :attr:`global_progress`."""
        await self._publish()
        return await self._read()

    async def _tick(self) -> None:
        await self._publish()
        # ticks come an interval after the last one ended: half an interval early is on time
        interval_s = self.config.publish_interval_s
        due_s = read_interval_s(self.num_keys_read, self.config) - 0.5 * interval_s
        if time.monotonic() - self._last_read_s >= due_s:
            await self._read()

    async def _publish(self) -> bool:
        """Store the own record at the levels written now, unless the last one stored there
        still tells readers the same (:func:`publish_due`); True if every store was taken."""
        async with self._publish_lock:
            started_s = time.monotonic()
            if self._cycle_start_s is not None:
                self._cycles_s.append(started_s - self._cycle_start_s)
            self._cycle_start_s = started_s
            if self._size.value is None:
                await self._probe()
            levels = tuple(write_levels(self._size.value or 1.0, self.config.records_per_bucket))
            own, now_s = self._own_record(), time.monotonic()
            if not publish_due(self._published, own, levels, now_s, self.config):
                return True
            lifetime_s = record_lifetime_s(self._cycles_s, self.config)
            owned = [self._owned_at(level) for level in levels]
            for record in owned:
                record.ttl_s = lifetime_s
            stored = await asyncio.gather(*(record.publish() for record in owned))
            self._published = (own, levels, now_s) if all(stored) else None
            return all(stored)

    async def _probe(self) -> None:
        raw = await self._probe_size()
        # a failed probe: a swarm of one until the next read says otherwise
        self._size.update(raw or 1.0, time.monotonic(), exact=True)

    async def _probe_size(self) -> float | None:
        """The size the own bucket at every level says (None: the probe failed)."""
        self._reprobe.mark(self._num_reads, time.monotonic())
        try:
            return await probe_size(
                self.dht,
                self.prefix,
                self.dht.peer_id,
                self.config.max_samples_per_s,
                replicas=self.config.read_replicas,
            )
        except DHTError as e:
            logger.warning("progress layout probe failed: %s", str(e) or type(e).__name__)
            return None

    def _owned_at(self, level: int) -> OwnedRecord:
        if level not in self._owned:
            key = bucket_key(self.prefix, level, bucket_of(self.dht.peer_id, level))
            self._owned[level] = OwnedRecord(
                dht=self.dht,
                key=key,
                make_value=self._own_value,
                ttl_s=self.config.record_ttl_s,
                interval_s=None,
                name=f"progress record (level {level})",
                replicas=self.config.store_replicas,
            )
        return self._owned[level]

    def _own_value(self, now: float) -> tuple[dict, float]:
        own = self._own_record()
        value = {
            "epoch": own.epoch,
            "samples": own.samples,
            "samples_per_s": own.samples_per_s,
            "time": own.time,
            "address": own.address,
            "client_mode": own.client_mode,
        }
        if own.arriving:  # absent means false: the usual record stays as it was
            value["arriving"] = True
        # expiring from now, not from the record's date (the last report, which a long round
        # can leave far behind): every refresh extends the record, and is newer than the last
        return value, now

    async def _read(self) -> GlobalProgress:
        async with self._read_lock:  # the later read wins, not the slower one
            self._last_read_s = time.monotonic()
            try:
                return await self._read_records()
            except DHTError as e:  # the network failed; the next refresh tries again
                logger.warning("progress read failed: %s", str(e) or type(e).__name__)
                return self.global_progress

    def _recent_partners(self) -> list[str]:
        """The partners, those of the most recent round first."""
        return list(dict.fromkeys(p for peers in reversed(self._rounds) for p in sorted(peers)))

    async def _read_records(self) -> GlobalProgress:
        level = self._size.level(self.config.records_per_bucket)
        partners = self._recent_partners()
        plan = plan_read(level, self.dht.peer_id, partners, self.config, self._rng, self._num_reads)
        self._num_reads += 1
        found: SampleRead = await read_sample(
            self.dht, self.prefix, plan, self.config.max_samples_per_s, self.config.read_replicas
        )
        self.num_keys_read = len(plan.buckets)
        raw, exact = found.raw_size(self.dht.peer_id), plan.complete
        if self._reprobe.due(self._num_reads, time.monotonic(), level, raw, self._size.value):
            raw, exact = Reprobe.adopt(raw, exact, await self._probe_size())
        size = self._size.update(raw, time.monotonic(), exact=exact)
        self._records = found.records
        self._sample = found.sample(partners, size)
        self.version += 1
        self.global_progress = self.current()
        return self.global_progress

    def current(self) -> GlobalProgress:
        """The swarm estimate now: the others' last records extrapolated, this peer's live
        numbers (no network; cheap enough to call after every local step)."""
        return estimate(
            self._records,
            own=self._own_record(),
            config=self.config,
            now=get_dht_time(),
            round_peers=self._round_peers,
            partners=self.partners,
            sample=self._sample,
            round_reach=self._round_reach,
        )

    def note_round(self, epoch: int, peer_ids, num_reached: int = 0) -> None:
        """The peers ``peer_ids`` averaged with this one and entered ``epoch`` just now: they
        are its partners for the next ``trust_rounds`` rounds. ``num_reached``: the peers the
        round reached in all (more than ``peer_ids`` after a top round), for whom the partners
        at ``epoch`` stand in the estimate (see :func:`estimate`)."""
        now = get_dht_time()
        peer_ids = frozenset(peer_ids) - {self.dht.peer_id}
        self._round_reach = (epoch, num_reached)
        self._round_peers = {peer_id: (epoch, now) for peer_id in peer_ids}
        self._rounds.append(peer_ids)
        self.partners = frozenset().union(*self._rounds)
        self.version += 1

    async def __aenter__(self) -> ProgressTracker:
        self._periodic.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop publishing; safe to call twice."""
        await self._periodic.stop()
        for owned in list(self._owned.values()):
            await owned.close()
