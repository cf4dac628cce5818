"""Progress over the DHT: peers publish their epoch and samples; each estimates the swarm's.

Every ``publish_interval_s`` a peer stores a signed, expiring record under its own subkey of
``{prefix}/progress`` and reads everyone's back. From those it estimates the swarm's epoch, how
many samples the swarm has accumulated toward ``target_batch_size`` in that epoch, and the ETA to
it, so that matchmaking can start just in time.

A record is a claim, so a minority of peers (or one stranger with a fresh key) must not steer it:

* Records pass the schema of :mod:`peer.records.progress` (typed, ranged; the rest is dropped).
* **Partners**: the peers this one averaged with in its last ``trust_rounds`` rounds. While any
  partner has a record, only the partners' samples count toward the target: a stranger's
  "target reached" record does not end an honest epoch early. A peer with no partner yet (a
  newcomer, the first epoch) counts every record, since it has nothing better.
* The swarm's epoch moves ahead of this peer's when at least two partners (or the only one) are
  there, or a strict majority of the other peers seen is.
* Rates count at most ``max_rate_ratio`` times the median rate of the peers counted; a partner
  that left the last round with this peer cannot claim more samples than its rate allows over
  the time since that round ended (plus ``epoch_skew_s``); no record counts beyond the target.
* Clock skew is tolerated: records are extrapolated by at most ``max_extrapolation_s``, and a
  negative age (a peer whose clock runs ahead) counts as zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from dht.config import get_dht_time
from dht.errors import ConfigError, DHTError
from dht.kademlia.node import DHTNode
from dht.owned_record import OwnedRecord
from peer.records.progress import PeerProgress, parse_record, progress_key

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


@dataclass(frozen=True, kw_only=True)
class ProgressConfig:
    """How progress is published and read.

    Attributes:
        target_batch_size: samples the swarm accumulates per epoch (one optimizer step).
        publish_interval_s: how often a peer publishes its record and reads the others', in s.
        record_ttl_s: a record expires this long after it is published, in seconds (a peer
            that vanished drops out of the estimates after at most this long).
        max_samples_per_s: the largest believable rate of one peer; larger claims are clamped.
        max_extrapolation_s: how far past its timestamp a record is extrapolated, in seconds.
        trust_rounds: the members of this peer's last this many rounds are its partners, whose
            records it counts (see the module docstring).
        max_rate_ratio: another peer's rate counts at most this many times the median rate of
            the peers counted (this one included).
        epoch_skew_s: how much earlier than this peer a partner of its last round may have
            entered the epoch (another group's round ended first), in seconds.
    """

    target_batch_size: int
    publish_interval_s: float = 2.0
    record_ttl_s: float = 20.0
    max_samples_per_s: float = 1e6
    max_extrapolation_s: float = 10.0
    trust_rounds: int = 8
    max_rate_ratio: float = 16.0
    epoch_skew_s: float = 5.0

    def __post_init__(self) -> None:
        if self.target_batch_size < 1:
            raise ConfigError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        if self.trust_rounds < 1:
            raise ConfigError(f"trust_rounds must be >= 1, got {self.trust_rounds}")
        for name in (
            "publish_interval_s",
            "record_ttl_s",
            "max_samples_per_s",
            "max_extrapolation_s",
            "max_rate_ratio",
            "epoch_skew_s",
        ):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.record_ttl_s <= self.publish_interval_s:
            raise ConfigError("record_ttl_s must exceed publish_interval_s")


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm as one peer estimates it (``peers``: this one first, then every other peer
    seen; only the counted ones are in ``samples_accumulated`` and ``samples_per_s``)."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    samples_per_s: float
    eta_next_epoch_s: float
    num_peers: int
    num_clients: int
    peers: tuple[PeerProgress, ...]

    @property
    def ready(self) -> bool:
        """Whether the swarm has (by this estimate) reached the target of its epoch."""
        return self.samples_accumulated >= self.target_batch_size


def _after_round(
    record: PeerProgress, round_peers: dict[str, tuple[int, float]] | None
) -> PeerProgress:
    entered = (round_peers or {}).get(record.peer_id)
    if entered is None or record.epoch >= entered[0]:
        return record
    epoch, round_end = entered
    return PeerProgress(
        record.peer_id,
        epoch,
        0,
        record.samples_per_s,
        round_end,
        record.address,
        record.client_mode,
    )


def _swarm_epoch(own_epoch: int, others: list[PeerProgress], partners: list[PeerProgress]) -> int:
    """The newest epoch ahead of ``own_epoch`` that two partners (or the only one) or a strict
    majority of the other peers have reached; ``own_epoch`` if none (O(n log n): thousands of
    records cost no more than sorting them)."""
    candidates = [own_epoch]
    if others:  # the (n // 2 + 1)-th newest epoch: a strict majority is there or beyond
        candidates.append(sorted((r.epoch for r in others), reverse=True)[len(others) // 2])
    if partners:  # the second newest of the partners' epochs (the newest, if only one)
        quorum = min(2, len(partners))
        candidates.append(sorted((r.epoch for r in partners), reverse=True)[quorum - 1])
    return max(candidates)


def _rate_cap(rates: Iterable[float], config: ProgressConfig) -> float:
    positive = [rate for rate in rates if rate > 0]
    if not positive:
        return config.max_samples_per_s
    return min(config.max_samples_per_s, config.max_rate_ratio * statistics.median(positive))


def estimate(
    records: list[PeerProgress],
    *,
    own: PeerProgress,
    config: ProgressConfig,
    now: float,
    round_peers: dict[str, tuple[int, float]] | None = None,
    partners: frozenset[str] = frozenset(),
) -> GlobalProgress:
    """The swarm's epoch, samples toward the target, rate and ETA, from ``records`` and ``own``.

    ``round_peers`` maps the peers of this peer's last round to (the epoch they entered, the
    DHT time the round ended): a record older than that round is read as that peer starting
    the new epoch at the round's end, which keeps fast epochs (shorter than the publishing
    interval) in step. ``partners`` are the peers trusted to count (see the module docstring).
    Never raises: every record passed the schema, so every number is bounded.
    """
    round_peers = round_peers or {}
    others = [_after_round(r, round_peers) for r in records if r.peer_id != own.peer_id]
    trusted = [r for r in others if r.peer_id in partners]
    epoch = _swarm_epoch(own.epoch, others, trusted)
    counted = trusted or others  # no partner here: a newcomer counts everyone it sees
    target = config.target_batch_size
    rate_cap = _rate_cap((r.samples_per_s for r in [own, *counted] if r.epoch == epoch), config)
    counted = [_capped_rate(r, rate_cap) for r in counted]
    accumulated = float(own.samples) if own.epoch == epoch else 0.0
    for record in counted:
        if record.epoch == epoch:
            accumulated += _claimed(record, now, config, round_peers.get(record.peer_id))
    accumulated = min(accumulated, float(target * (1 + len(counted))))
    rate = own.samples_per_s + sum(record.samples_per_s for record in counted)
    missing = max(0.0, target - accumulated)
    eta_s = 0.0 if not missing else (missing / rate if rate > 0 else math.inf)
    # every peer seen, counted or not: who is at this epoch sizes groups (seats for newcomers;
    # partners keep theirs, see averaging.matchmaking.leader) and tells a peer whether it is alone
    counted_ids = {r.peer_id for r in counted}
    peers = [
        own,
        *counted,
        *(_capped_rate(r, rate_cap) for r in others if r.peer_id not in counted_ids),
    ]
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=int(accumulated),
        target_batch_size=target,
        samples_per_s=rate,
        eta_next_epoch_s=eta_s,
        num_peers=len(peers),
        num_clients=sum(r.client_mode for r in peers),
        peers=tuple(peers),
    )


def _capped_rate(record: PeerProgress, rate_cap: float) -> PeerProgress:
    if record.samples_per_s <= rate_cap:
        return record
    return dataclasses.replace(record, samples_per_s=rate_cap)


def _claimed(
    record: PeerProgress,
    now: float,
    config: ProgressConfig,
    entered: tuple[int, float] | None,
) -> float:
    """The samples ``record`` counts for now: extrapolated by its rate (bounded in time), no
    more than the target, and for a partner that entered this epoch at the end of this peer's
    last round, no more than its rate allows since then."""
    age_s = min(max(now - record.time, 0.0), config.max_extrapolation_s)
    claimed = min(record.samples + record.samples_per_s * age_s, float(config.target_batch_size))
    if entered is not None and entered[0] == record.epoch:
        elapsed_s = max(0.0, now - entered[1]) + config.epoch_skew_s
        claimed = min(claimed, record.samples_per_s * elapsed_s)
    return claimed


class ProgressTracker:
    """Publishes this peer's progress and keeps an estimate of the swarm's.

    The training loop calls :meth:`report_local_progress` from its own thread (plain attribute
    writes); the tracker's task on the event loop publishes and reads every
    ``publish_interval_s`` and whenever :meth:`refresh` is awaited.
    """

    def __init__(self, *, dht: DHTNode, prefix: str, config: ProgressConfig):
        self.dht = dht
        self.key = progress_key(prefix)
        self.config = config
        self._samples_per_s = 0.0
        self._rate_time_s = 0.0  # seconds the rate averages over (up to publish_interval_s)
        self._last_report: tuple[float, int, int] | None = None  # (monotonic s, epoch, samples)
        self._num_continued = _num_continued[0]  # stops of the process seen by the last report
        self.global_progress = estimate(
            [], own=self._own_record(), config=config, now=get_dht_time()
        )
        self._records: list[PeerProgress] = []
        # bumped when the records or the last round's members change (see ``current``)
        self.version = 0
        self._round_peers: dict[str, tuple[int, float]] = {}
        self._rounds: deque[frozenset[str]] = deque(maxlen=config.trust_rounds)
        self.partners: frozenset[str] = frozenset()
        self._read_lock = asyncio.Lock()
        self._own = OwnedRecord(
            dht=dht,
            key=self.key,
            make_value=self._own_value,
            ttl_s=config.record_ttl_s,
            interval_s=config.publish_interval_s,
            name="progress record",
            after=lambda stored: self._read(),
        )

    def report_local_progress(self, epoch: int, samples: int) -> None:
        """This peer is at ``epoch`` with ``samples`` accumulated toward its target.

        Call it at every epoch change and before :meth:`current`; in between, every few local
        steps is enough: the record is dated when its numbers were true, and readers extrapolate
        the samples since.
        """
        now = time.monotonic()
        if self._last_report is not None:
            last_time, last_epoch, last_samples = self._last_report
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
        self._last_report = (now, epoch, samples)
        self._num_continued = _num_continued[0]

    def _own_record(self) -> PeerProgress:
        report, now = self._last_report, get_dht_time()
        epoch = samples = 0
        if report is not None:
            reported_s, epoch, samples = report
            now -= max(0.0, time.monotonic() - reported_s)
        return PeerProgress(
            self.dht.peer_id,
            epoch,
            samples,
            min(self._samples_per_s, self.config.max_samples_per_s),
            now,
            self.dht.address,
            self.dht.address is None,
        )

    async def refresh(self) -> GlobalProgress:
        """Publish the own record, read everyone's and update :attr:`global_progress`."""
        await self._own.publish()
        return await self._read()

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
        # expiring from now, not from the record's date (the last report, which a long round
        # can leave far behind): every refresh extends the record, and is newer than the last
        return value, now

    async def _read(self) -> GlobalProgress:
        async with self._read_lock:  # the later read wins, not the slower one
            try:
                return await self._read_records()
            except DHTError as e:  # the network failed; the next refresh tries again
                logger.warning("progress read failed: %s", str(e) or type(e).__name__)
                return self.global_progress

    async def _read_records(self) -> GlobalProgress:
        own = self._own_record()
        found = await self.dht.get(self.key, latest=True)
        records = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                record = parse_record(subkey, item.value, self.config.max_samples_per_s)
                if record is not None:
                    records.append(record)
        self._records = records
        self.version += 1
        self.global_progress = estimate(
            records,
            own=own,
            config=self.config,
            now=get_dht_time(),
            round_peers=self._round_peers,
            partners=self.partners,
        )
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
        )

    def note_round(self, epoch: int, peer_ids) -> None:
        """The peers ``peer_ids`` averaged with this one and entered ``epoch`` just now: they
        are its partners for the next ``trust_rounds`` rounds."""
        now = get_dht_time()
        peer_ids = frozenset(peer_ids) - {self.dht.peer_id}
        self._round_peers = {peer_id: (epoch, now) for peer_id in peer_ids}
        self._rounds.append(peer_ids)
        self.partners = frozenset().union(*self._rounds)
        self.version += 1

    async def __aenter__(self) -> ProgressTracker:
        self._own.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop publishing; safe to call twice."""
        await self._own.close()
