"""Which progress buckets a peer reads, and the swarm's size it estimates from them.

Every interval a peer reads at most ``max_buckets_read`` buckets of the layout its size estimate
calls for (:func:`peer.records.progress.read_level`): all of them when there are that few (and
when there are at most ``max_whole_buckets``, the records count as every peer's, not as a
sample: the trust rules of a small swarm), else its own bucket, the buckets of up to
``max_partner_buckets`` partners (the most recent first, rotating when there are more) and
random ones for the rest. The random buckets are a uniform draw, so ``2**level`` times their
mean fill is an unbiased count of the swarm; :class:`SizeEstimate` averages it over the last
``size_window_s`` (each interval draws new buckets). A peer with no estimate yet probes its own
bucket at every other level, then beside the fullest
(:func:`peer.records.progress_read.probe_size`); every peer probes again now and then, and at
once when a read says its layout is not in use (:func:`reprobe_needed`), and a probe that counts
twice the estimate or more replaces it: peers that settled in a layout of their own (they count
only each other) find the swarm again.

Reads are bounded whatever the swarm's size: ``max_buckets_read`` keys of about
``records_per_bucket`` records each (a key holds 16 to 32 records, about 6 KiB at most in a
steady swarm, far below the DHT's per-key cap), each merged from the key's ``num_replicas``
replicas (20 by default, :class:`dht.kademlia.config.DHTConfig`).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from peer.records.progress import PeerProgress, bucket_of, read_level
from peer.records.progress_read import ValueReader, newest_per_peer, read_bucket
from peer.swarm.progress_config import ProgressConfig
from peer.swarm.progress_estimate import Sample


@dataclass(frozen=True)
class ReadPlan:
    """The buckets of one read.

    Attributes:
        level: the layout read (``2**level`` buckets).
        buckets: every bucket to read, each once.
        drawn: the buckets drawn at random (the size estimate's); every one when they are few.
        whole: the records are read as every peer's (a layout of at most
            ``max_whole_buckets``), not as a sample (see :mod:`peer.swarm.progress_estimate`).
    """

    level: int
    buckets: tuple[int, ...]
    drawn: tuple[int, ...]
    whole: bool

    @property
    def complete(self) -> bool:
        """Every bucket of the level is read (the size is a count, not an estimate)."""
        return len(self.drawn) == 2**self.level


def plan_read(
    level: int,
    own_id: str,
    partners: Sequence[str],
    config: ProgressConfig,
    rng: random.Random,
    rotation: int = 0,
) -> ReadPlan:
    """The buckets to read at ``level``; ``partners`` most recent first, ``rotation`` shifts
    the window over them when more than ``max_partner_buckets`` buckets hold partners."""
    num_buckets = 2**level
    if num_buckets <= config.max_buckets_read:
        every = tuple(range(num_buckets))
        return ReadPlan(level, every, every, num_buckets <= config.max_whole_buckets)
    own = bucket_of(own_id, level)
    candidates = list(dict.fromkeys(bucket_of(p, level) for p in partners))
    candidates = [b for b in candidates if b != own]
    if len(candidates) > config.max_partner_buckets:
        start = rotation % len(candidates)
        candidates = (candidates[start:] + candidates[:start])[: config.max_partner_buckets]
    num_drawn = config.max_buckets_read - 1 - len(candidates)
    drawn = tuple(rng.sample(range(num_buckets), num_drawn))
    buckets = tuple(dict.fromkeys([own, *candidates, *drawn]))
    return ReadPlan(level, buckets, drawn, False)


@dataclass(frozen=True)
class SampleRead:
    """What one read found: ``records`` (newest per peer) and each bucket's fill."""

    plan: ReadPlan
    records: list[PeerProgress]
    fills: dict[int, int]

    def raw_size(self, own_id: str) -> float:
        """The swarm's size by this read alone (this peer included)."""
        if self.plan.complete:
            return float(len({r.peer_id for r in self.records} | {own_id}))
        drawn = [self.fills[b] for b in self.plan.drawn]
        return 2**self.plan.level * sum(drawn) / len(drawn)

    def sample(self, partners: Iterable[str], num_peers: float) -> Sample | None:
        """How :func:`peer.swarm.progress_estimate.estimate` reads these records."""
        if self.plan.whole:
            return None
        read = set(self.plan.buckets)
        known = frozenset(p for p in partners if bucket_of(p, self.plan.level) in read)
        return Sample(known=known, num_peers=num_peers)


async def read_sample(
    node: ValueReader,
    run_id: str,
    plan: ReadPlan,
    max_samples_per_s: float,
    replicas: int | None = None,
) -> SampleRead:
    """Read the buckets of ``plan`` at once (raises what ``node.get`` raises), each merged
    from its ``replicas`` closest replicas (None: all ``num_replicas``): one replica's copy
    (``latest=False``) misses the records of writers whose stores reached other nodes (a stray
    copy, a lookup cut short on a busy host); at 256 peers on 2 cores such reads counted 100 to
    150 peers, and the layout they chose held only the peers that counted as few."""
    found = await asyncio.gather(
        *(
            read_bucket(node, run_id, plan.level, b, max_samples_per_s, replicas=replicas)
            for b in plan.buckets
        )
    )
    fills = {
        b: len({r.peer_id for r in records}) for b, records in zip(plan.buckets, found, strict=True)
    }
    records = newest_per_peer(r for bucket in found for r in bucket)
    return SampleRead(plan, records, fills)


def reprobe_needed(level: int, raw: float, records_per_bucket: int, current: float | None) -> bool:
    """Whether a read of layout ``level`` that counted ``raw`` peers may have lost the swarm,
    not seen it shrink: it counted less than half the ``current`` estimate, or less than half
    of what the layout's writers would fill. Peers see each other within a factor of about
    sqrt(2) of their estimates; a cohort whose estimate lags the swarm's (its reads slower than
    the others') loses sight of it as the others move to the next layout, then counts ever
    fewer, one layout down at a time, and at last only the few that fell with it (at 256 peers
    on 2 cores, 13 of them counted each other as the swarm for the rest of the run)."""
    if current is not None and raw < current / 2:
        return True
    return read_level(raw, records_per_bucket) <= level - 2


# A peer probes every level again after this many reads (a probe reads about 10 keys, a read
# up to 8): peers that settled in a layout of their own find the swarm. Counted in reads, not
# seconds: at 256 peers on 2 cores a probe every 60 s, with reads 35 s apart, doubled the keys
# read and the reads took 70-90 s.
REPROBE_EVERY_READS = 30
# ... and any probe at most once per this many publishing intervals: a peer of 20-ms epochs
# reads at every epoch, and 30 reads went by in a second.
REPROBE_GAP_INTERVALS = 10


class Reprobe:
    """When a peer probes every level again (:func:`reprobe_needed`, or every
    ``REPROBE_EVERY_READS`` reads; at most once per ``REPROBE_GAP_INTERVALS`` intervals), and
    what a probe's count does to a read's: replaces it when it is twice as many or more."""

    def __init__(self, publish_interval_s: float, records_per_bucket: int, now_s: float):
        self.gap_s = REPROBE_GAP_INTERVALS * publish_interval_s
        self.records_per_bucket = records_per_bucket
        self.at_read, self.at_s = 0, now_s

    def mark(self, num_reads: int, now_s: float) -> None:
        """A probe starts now."""
        self.at_read, self.at_s = num_reads, now_s

    def due(
        self, num_reads: int, now_s: float, level: int, raw: float, current: float | None
    ) -> bool:
        wanted = num_reads - self.at_read >= REPROBE_EVERY_READS or reprobe_needed(
            level, raw, self.records_per_bucket, current
        )
        return wanted and now_s - self.at_s >= self.gap_s

    @staticmethod
    def adopt(raw: float, exact: bool, probed: float | None) -> tuple[float, bool]:
        """The read's count and exactness after a probe (None: it failed)."""
        if probed is not None and probed >= 2 * raw:  # another layout holds more peers
            return probed, True
        return raw, exact


class SizeEstimate:
    """The swarm's size, smoothed: the mean of the raw counts of the last ``window_s`` (a step
    in the swarm's size is followed within that long); a count of every record (``exact``)
    replaces them outright."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.value: float | None = None
        self._counts: deque[tuple[float, float]] = deque()  # (time s, raw count)

    def update(self, raw: float, now_s: float, *, exact: bool) -> float:
        if exact:
            self._counts.clear()
        self._counts.append((now_s, raw))
        while self._counts[0][0] < now_s - self.window_s:
            self._counts.popleft()
        self.value = sum(count for _, count in self._counts) / len(self._counts)
        return self.value

    def level(self, records_per_bucket: int) -> int:
        """The level to read at (0 while nothing is known)."""
        return read_level(self.value or 1.0, records_per_bucket)
