"""The progress record: one peer's epoch, samples and rate; its parser; the keys it lives under.

Keys (bucketed, so that no key and no reader grows with the swarm): a peer stores its record
under ``{run_id}/progress/{level}/{bucket}``, where ``level`` sets the layout (``2**level``
buckets) and ``bucket`` is the top ``level`` bits of ``sha256(peer id)``
(:func:`bucket_of`; level 0 is the one bucket ``0``). A bucket of level ``l`` is the union of
its two children of level ``l + 1``. Each peer writes the two levels around its estimate of the
swarm's size (:func:`write_levels`) and reads the one nearest to it (:func:`read_level`), so
that peers whose estimates differ by less than a factor sqrt(2) see each other's records; a
bucket holds about ``records_per_bucket`` (16 to 32) records whatever the swarm's size.
:func:`find_level` tells a reader with no estimate (a newcomer, the dashboard) which layout is in
use.

Wire format (a msgpack map under the publisher's owner subkey; unknown fields are ignored):
``epoch`` int in [0, 2**53), ``samples`` int in [0, 2**53), ``samples_per_s`` finite float in
[0, 1e12], ``time`` the publisher's DHT time (finite, in [0, 1e11]), ``address`` an
``http(s)://host:port`` URL or None, ``client_mode`` bool, ``arriving`` bool (optional, false
when absent: the peer announces ``epoch`` ahead of the state download that puts it there, see
:mod:`peer.swarm.arrival`). A record that does not fit is dropped
and counted (:mod:`peer.records.schema`). Torch-free, like everything in :mod:`peer.records`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

from peer.records.schema import (
    Count,
    PeerUrl,
    Rate,
    Seconds,
    WireModel,
    check_multiaddr,
    owner_of,
    parse_value,
)

PROGRESS_KEY_SUFFIX = "progress"
# The finest layout: 65,536 buckets (with 16 to 32 records each, swarms of a million peers).
MAX_LEVEL = 16
# How many records a bucket holds, about: a layout constant every peer of a run shares
# (``ProgressConfig.records_per_bucket``; tests set it lower to sample small swarms).
RECORDS_PER_BUCKET = 16
# A newcomer or the dashboard probes every other level (a peer writes two neighbouring ones).
PROBE_LEVELS = tuple(range(0, MAX_LEVEL + 1, 2))


def progress_key(run_id: str) -> str:
    """The prefix of a run's progress keys (no record lives under it alone)."""
    return f"{run_id}/{PROGRESS_KEY_SUFFIX}"


def bucket_key(run_id: str, level: int, bucket: int) -> str:
    """The DHT key of bucket ``bucket`` of layout ``level`` (``2**level`` buckets)."""
    if not 0 <= level <= MAX_LEVEL or not 0 <= bucket < 2**level:
        raise ValueError(f"no bucket {bucket} at level {level}")
    return f"{progress_key(run_id)}/{level}/{bucket}"


def bucket_of(peer_id: str, level: int) -> int:
    """The bucket of ``peer_id`` at ``level``: the top ``level`` bits of sha256(peer id)."""
    return _hash32(peer_id) >> (32 - level) if level else 0


@functools.lru_cache(maxsize=1 << 16)
def _hash32(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")


def size_exponent(num_peers: float, records_per_bucket: int) -> float:
    """``log2(N / records_per_bucket)``: the (fractional) level that fills buckets as wanted."""
    return math.log2(max(num_peers, 1.0) / records_per_bucket)


def read_level(num_peers: float, records_per_bucket: int) -> int:
    """The level a peer reads: the nearest to :func:`size_exponent` (within ``[0, MAX_LEVEL]``)."""
    exponent = size_exponent(num_peers, records_per_bucket)
    return min(MAX_LEVEL, max(0, math.floor(exponent + 0.5)))


def write_levels(num_peers: float, records_per_bucket: int) -> tuple[int, ...]:
    """The levels a peer writes: the two around :func:`size_exponent` (one at the ends).

    A reader whose exponent is within 0.5 of the writer's reads one of them: ``|round(x_r) -
    x_w| < 1`` makes ``round(x_r)`` the floor or the ceiling of ``x_w``.
    """
    low = math.floor(size_exponent(num_peers, records_per_bucket))
    levels = {min(MAX_LEVEL, max(0, low)), min(MAX_LEVEL, max(0, low + 1))}
    return tuple(sorted(levels))


@dataclass(frozen=True)
class PeerProgress:
    """One peer's published progress (times are the publisher's DHT time)."""

    peer_id: str
    epoch: int
    samples: int
    samples_per_s: float
    time: float
    address: str | None
    client_mode: bool
    # announced ahead of a state download (peer.swarm.arrival): the peer is not there yet
    arriving: bool = False


class ProgressWire(WireModel):
    """The progress record's value as it travels (see the module docstring)."""

    epoch: Count
    samples: Count
    samples_per_s: Rate
    time: Seconds
    address: PeerUrl | None = None
    client_mode: bool = False
    arriving: bool = False


class HivemindProgressWire(ProgressWire):
    """The same record published by the hivemind backend: its address is a multiaddr."""

    address: Annotated[str, AfterValidator(check_multiaddr)] | None = None  # type: ignore[assignment]


def parse_record(
    subkey: object, value: object, max_samples_per_s: float, *, multiaddr: bool = False
) -> PeerProgress | None:
    """A peer's record from the DHT, or None (counted) if it does not fit the schema.

    The rate is clamped to ``max_samples_per_s``, the reader's largest believable rate.
    ``multiaddr`` reads the hivemind backend's records (libp2p addresses).
    """
    peer_id = owner_of(subkey)
    model = HivemindProgressWire if multiaddr else ProgressWire
    wire = parse_value(model, "progress", peer_id, value)
    if wire is None or peer_id is None:
        return None
    rate = min(wire.samples_per_s, max_samples_per_s)
    return PeerProgress(
        peer_id,
        wire.epoch,
        wire.samples,
        rate,
        wire.time,
        wire.address,
        wire.client_mode,
        wire.arriving,
    )
