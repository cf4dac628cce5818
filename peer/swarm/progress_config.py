"""How a peer publishes and reads the swarm's progress: :class:`ProgressConfig` (its fields'
units and the checks that name them), read by the tracker (:mod:`peer.swarm.progress`), the
estimate (:mod:`peer.swarm.progress_estimate`) and the front ends that expose its fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dht.errors import ConfigError
from dht.kademlia.config import read_replicas_problem, store_replicas_problem
from peer.records.progress import RECORDS_PER_BUCKET


@dataclass(frozen=True, kw_only=True)
class ProgressConfig:
    """How progress is published and read.

    Attributes:
        target_batch_size: samples the swarm accumulates per epoch (one optimizer step).
        publish_interval_s: how often a peer publishes its record and reads the others', in s.
        record_ttl_s: a record expires this long after it is published, in seconds (a peer
            that vanished drops out of the estimates after at most this long), or after three
            of its publisher's refresh cycles where those run longer (a busy host; at most ten
            times this; :func:`peer.swarm.progress_schedule.record_lifetime_s`).
        max_samples_per_s: the largest believable rate of one peer; larger claims are clamped.
        max_extrapolation_s: how far past its timestamp a record is extrapolated, in seconds.
        trust_rounds: the members of this peer's last this many rounds are its partners, whose
            records it counts (see the module docstring).
        max_rate_ratio: another peer's rate counts at most this many times the median rate of
            the peers counted (this one included).
        epoch_skew_s: how much earlier than this peer a partner of its last round may have
            entered the epoch (another group's round ended first), in seconds.
        records_per_bucket: how many records a progress bucket holds, about (16 to 32; the
            layout of :mod:`peer.records.progress` follows the swarm's estimated size); every
            peer of a run, and its dashboard, must use the same.
        max_buckets_read: the most buckets a peer reads per interval (the bound of a peer's
            reads); a layout of more buckets is sampled.
        max_whole_buckets: a layout of at most this many buckets (a swarm of up to about 45
            peers, with 2) is read as every peer's records, under the trust rules of a small
            swarm (only partners count, once there are partners); a larger one as a sample,
            in which the others count too (see the module docstring). A swarm many times the
            group size cannot be counted by its partners alone.
        max_partner_buckets: of those, at most this many are read for the partners in them.
        max_keys_read_per_interval: the periodic reads take at most this many bucket keys
            per ``publish_interval_s``, on average: a layout sampled with more keys is read
            every ``num_keys / this`` intervals, but at least every ``max_extrapolation_s``
            less ``publish_gap_s`` seconds, so that no record read outgrows its extrapolation
            (publishing still runs every interval, and :meth:`ProgressTracker.refresh` always
            reads). A swarm of up to about 45 peers (two keys) reads every interval as
            before; 64 peers (four keys) every other one; larger swarms (eight keys) every
            5 s with the defaults. None: every interval, however many keys.
        size_window_s: the swarm's estimated size is the mean of the counts of the reads of
            the last this long (each draws other buckets), in seconds.
        max_stranger_claim_ratio: in a sample, a stranger's samples count at most this many
            times the partners' mean (see the module docstring).
        max_publish_gap_s: a record that readers' extrapolation still predicts (the same
            epoch, samples and rate within half an interval's samples) is republished only
            after this long, in seconds (at most half of ``record_ttl_s`` and of
            ``max_extrapolation_s``; None, or ``publish_interval_s`` or less: every
            interval). A peer training at a steady rate then stores its record every few
            intervals, not every one.
        read_replicas: each bucket read (and each bucket of a layout probe) merges the records
            of this many of the bucket key's closest replicas (None: all of the DHT's
            ``num_replicas``, 20 by default). Each one more is one more request and bucket
            copy per read.
        store_replicas: each store of the own record goes to this many of the bucket key's
            closest nodes (None: all ``num_replicas``). At least ``read_replicas``: readers
            merge the closest ones, and a writer whose lookup saw the key's neighbourhood a
            little differently must still reach them.

            The three savings are on by default (8 read, 12 written, a record every 5 s at
            most while readers predict it): at 16 light peers on 2 cores they cut the DHT
            requests per peer per second from 19.4 to about 11, and the CPU per round to
            0.65-0.73 of what it was at 16 peers and 0.62-0.65 at 64 (docs/BENCHMARKS.md,
            "Progress on fewer replicas, by default"). hivemind stores every value on 5.
    """

    target_batch_size: int
    publish_interval_s: float = 2.0
    record_ttl_s: float = 20.0
    max_samples_per_s: float = 1e6
    max_extrapolation_s: float = 10.0
    trust_rounds: int = 8
    max_rate_ratio: float = 16.0
    epoch_skew_s: float = 5.0
    records_per_bucket: int = RECORDS_PER_BUCKET
    max_buckets_read: int = 8
    max_whole_buckets: int = 2
    max_partner_buckets: int = 3
    max_keys_read_per_interval: int | None = 2
    size_window_s: float = 20.0
    max_stranger_claim_ratio: float = 4.0
    max_publish_gap_s: float | None = 5.0
    read_replicas: int | None = 8
    store_replicas: int | None = 12

    def __post_init__(self) -> None:
        for name in ("read_replicas", "store_replicas"):
            if problem := read_replicas_problem(getattr(self, name)):
                raise ConfigError(f"{name} {problem}")
        if problem := store_replicas_problem(self.store_replicas, self.read_replicas):
            raise ConfigError(f"store_replicas {problem}")
        for name in ("target_batch_size", "trust_rounds", "records_per_bucket"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_partner_buckets < 0:
            raise ConfigError(f"max_partner_buckets must be >= 0, got {self.max_partner_buckets}")
        if not 1 <= self.max_whole_buckets <= self.max_buckets_read:
            raise ConfigError(
                f"max_whole_buckets must be in [1, max_buckets_read], got {self.max_whole_buckets}"
            )
        if self.max_buckets_read < self.max_partner_buckets + 2:
            raise ConfigError(
                "max_buckets_read must leave room for the own bucket and a random one "
                f"besides {self.max_partner_buckets} partner buckets, got {self.max_buckets_read}"
            )
        for name in (
            "publish_interval_s",
            "record_ttl_s",
            "max_samples_per_s",
            "max_extrapolation_s",
            "max_rate_ratio",
            "epoch_skew_s",
            "size_window_s",
            "max_stranger_claim_ratio",
        ):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        keys = self.max_keys_read_per_interval
        if keys is not None and (isinstance(keys, bool) or not isinstance(keys, int) or keys < 1):
            raise ConfigError(f"max_keys_read_per_interval must be None or >= 1, got {keys!r}")
        if self.max_publish_gap_s is not None and not 0 < self.max_publish_gap_s < math.inf:
            raise ConfigError(
                f"max_publish_gap_s must be None or positive, got {self.max_publish_gap_s}"
            )
        if self.record_ttl_s <= self.publish_interval_s:
            raise ConfigError("record_ttl_s must exceed publish_interval_s")

    @property
    def publish_gap_s(self) -> float:
        """The longest a record that readers still predict goes unpublished, in seconds."""
        if self.max_publish_gap_s is None:
            return self.publish_interval_s
        return min(self.max_publish_gap_s, self.record_ttl_s / 2, self.max_extrapolation_s / 2)


def progress_default(name: str):
    """The default of the :class:`ProgressConfig` field ``name`` (for front ends that expose
    it and must not drift from the config)."""
    return next(f.default for f in dataclasses.fields(ProgressConfig) if f.name == name)
