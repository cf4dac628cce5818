"""When a peer stores its progress record and reads the others', and how long a record lives:
the schedule of :class:`peer.swarm.progress.ProgressTracker` (and of the simulation's peers,
:mod:`peer.bench.swarm_sim_events`)."""

from __future__ import annotations

from collections.abc import Iterable

from peer.records.progress import PeerProgress
from peer.swarm.progress_config import ProgressConfig

# the last record stored at every level written: (record, levels, monotonic s when stored)
Published = tuple[PeerProgress, tuple[int, ...], float]


def publish_due(
    last: Published | None,
    own: PeerProgress,
    levels: tuple[int, ...],
    now_s: float,
    config: ProgressConfig,
) -> bool:
    """Whether ``own`` must be stored now, or readers would learn nothing new from it.

    Readers extrapolate a record by its rate (:func:`peer.swarm.progress_estimate.estimate`),
    so the record last stored predicts this peer as long as its epoch is the same and its
    samples keep to that line (within half a publishing interval's samples) and its rate is
    within half of the stored one, until the next due store (``publish_gap_s``, bounded by the
    record's lifetime and by how far readers extrapolate). A peer that stalls, changes its pace
    by half or enters an epoch is stored at the next interval, as before; one that changes it
    less, once the line is off by that much; a steady one every ``publish_gap_s``. Every store
    goes to every replica of two keys: at 64 light peers on one host these were a quarter of
    the DHT's requests.
    """
    if last is None or config.publish_gap_s <= config.publish_interval_s:
        return True
    record, last_levels, stored_s = last
    if levels != last_levels or (own.epoch, own.address, own.arriving) != (
        record.epoch,
        record.address,
        record.arriving,
    ):
        return True
    if now_s - stored_s >= config.publish_gap_s - 0.5 * config.publish_interval_s:
        return True  # the next tick would be past the gap
    tolerance = max(1.0, 0.5 * own.samples_per_s * config.publish_interval_s)
    # the stored line at this peer's last report, and how far apart the lines drift by the gap
    predicted = record.samples + record.samples_per_s * max(0.0, own.time - record.time)
    # a rate half again off: stored now, not once the line is off (the drift catches smaller
    # changes within the gap; a rate noisy from step to step on a busy host stored every tick)
    rate_error = abs(own.samples_per_s - record.samples_per_s) * config.publish_interval_s
    return abs(own.samples - predicted) > tolerance or rate_error > tolerance


# A record outlives this many of its publisher's refresh cycles (publish, read, the interval):
# at 256 light peers on 2 cores a cycle took 15-23 s, past the 20-s lifetime, so most records
# had expired before their refresh and every peer counted a third of the swarm or less.
RECORD_CYCLES = 3
# ... but at most this many times ``record_ttl_s``: a peer that vanished still drops out.
MAX_LIFETIME_RATIO = 10


def read_interval_s(num_keys: int, config: ProgressConfig) -> float:
    """How often the periodic refresh reads ``num_keys`` bucket keys, in seconds: every
    ``publish_interval_s``, or every few where a read takes more than
    ``max_keys_read_per_interval`` keys, but never so rarely that a record read outgrows
    ``max_extrapolation_s`` before the next read (it is up to ``publish_gap_s`` old when read).

    At 64 light peers (four keys every 2 s) progress reads were 63% of the DHT requests and
    81% of their bytes, about four times a 16-peer swarm's per peer. Read every 8 s, 1,000
    simulated peers' records reached 13 s of age, past the 10-s extrapolation bound: the
    estimate's error at the 95th percentile went from 0.11 to 0.49."""
    keys = config.max_keys_read_per_interval
    interval_s = config.publish_interval_s
    if keys is None:
        return interval_s
    fresh_s = config.max_extrapolation_s - config.publish_gap_s
    return max(interval_s, min(interval_s * num_keys / keys, fresh_s))


def record_lifetime_s(cycles_s: Iterable[float], config: ProgressConfig) -> float:
    """How long a record stored now lives, in seconds: ``record_ttl_s``, or
    ``RECORD_CYCLES`` of the longest of this peer's recent refresh cycles ``cycles_s`` if
    that is longer (up to ``MAX_LIFETIME_RATIO`` times ``record_ttl_s``)."""
    longest_s = max(cycles_s, default=0.0)
    return min(
        MAX_LIFETIME_RATIO * config.record_ttl_s,
        max(config.record_ttl_s, RECORD_CYCLES * longest_s),
    )
