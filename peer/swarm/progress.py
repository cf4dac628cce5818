"""Progress over the DHT: peers publish their epoch and samples; each estimates the swarm's.

Every ``publish_interval_s`` a peer stores a signed, expiring record under its own subkey of
``{prefix}/progress`` and reads everyone's back. From those it estimates the swarm's epoch, how
many samples the swarm has accumulated toward ``target_batch_size`` in that epoch, and the ETA to
it, so that matchmaking can start just in time.

Defences against a bad or malicious record: rates are clamped to ``max_samples_per_s`` and samples
to the target; a record that claims an epoch ahead of ours moves the swarm epoch only when more
than one peer backs it (or every other peer does, in a swarm of two); malformed records are
ignored. Clock skew is tolerated: records are extrapolated by at most ``max_extrapolation_s``, and
a negative age (a peer whose clock runs ahead) counts as zero.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from dht.config import get_dht_time
from dht.errors import ConfigError
from dht.node import DHTNode
from dht.owned_record import OwnedRecord
from peer.records.progress import PeerProgress, parse_record, progress_key

logger = logging.getLogger(__name__)


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
    """

    target_batch_size: int
    publish_interval_s: float = 2.0
    record_ttl_s: float = 20.0
    max_samples_per_s: float = 1e6
    max_extrapolation_s: float = 10.0

    def __post_init__(self) -> None:
        if self.target_batch_size < 1:
            raise ConfigError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        for name in (
            "publish_interval_s",
            "record_ttl_s",
            "max_samples_per_s",
            "max_extrapolation_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.record_ttl_s <= self.publish_interval_s:
            raise ConfigError("record_ttl_s must exceed publish_interval_s")


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm as one peer estimates it."""

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


def estimate(
    records: list[PeerProgress],
    *,
    own: PeerProgress,
    config: ProgressConfig,
    now: float,
    round_peers: dict[str, tuple[int, float]] | None = None,
) -> GlobalProgress:
    """The swarm's epoch, samples toward the target, rate and ETA, from ``records`` and ``own``.

    ``round_peers`` maps the peers of this peer's last round to (the epoch they entered, the
    DHT time the round ended): a record older than that round is read as that peer starting
    the new epoch at the round's end, which keeps fast epochs (shorter than the publishing
    interval) in step.
    """
    others = [_after_round(r, round_peers) for r in records if r.peer_id != own.peer_id]
    peers = [own, *others]
    quorum = min(2, len(others))
    epoch = own.epoch
    for candidate in sorted({r.epoch for r in others if r.epoch > own.epoch}, reverse=True):
        if sum(r.epoch >= candidate for r in others) >= max(quorum, 1):
            epoch = candidate
            break
    accumulated = 0.0
    for record in peers:
        if record.epoch == epoch:
            age_s = (
                0.0
                if record is own
                else min(max(now - record.time, 0.0), config.max_extrapolation_s)
            )
            accumulated += record.samples + record.samples_per_s * age_s
    target = config.target_batch_size
    accumulated = min(accumulated, float(target * max(1, len(peers))))
    rate = sum(record.samples_per_s for record in peers)
    missing = max(0.0, target - accumulated)
    eta_s = 0.0 if not missing else (missing / rate if rate > 0 else math.inf)
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
        self.global_progress = estimate(
            [], own=self._own_record(), config=config, now=get_dht_time()
        )
        self._records: list[PeerProgress] = []
        # bumped when the records or the last round's members change (see ``current``)
        self.version = 0
        self._round_peers: dict[str, tuple[int, float]] = {}
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
            if elapsed_s > 0 and new_samples > 0:
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
            return await self._read_records()

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
            records, own=own, config=self.config, now=get_dht_time(), round_peers=self._round_peers
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
        )

    def note_round(self, epoch: int, peer_ids) -> None:
        """The peers ``peer_ids`` averaged with this one and entered ``epoch`` just now."""
        now = get_dht_time()
        self._round_peers = {peer_id: (epoch, now) for peer_id in peer_ids}
        self.version += 1

    async def __aenter__(self) -> ProgressTracker:
        self._own.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop publishing; safe to call twice."""
        await self._own.close()
