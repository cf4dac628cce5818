"""Reading progress buckets: one bucket (for a peer's sample), the own bucket at every level (a
probe of the swarm's size, :func:`probe_size`), or every bucket (for the dashboard).

A peer reads a bounded sample of buckets (:mod:`peer.swarm.progress_sample`); the dashboard is no
peer and shows every peer, so it reads every bucket of the layout in use
(:class:`ProgressSweep`). A bucket's records are kept only when the peer they belong to hashes to
that bucket (:func:`peer.records.progress.bucket_of`): a record stored under another key (by a
stranger, or left behind by a peer that changed level) counts nowhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Protocol

from peer.records.buckets import levels_around
from peer.records.progress import (
    MAX_LEVEL,
    PROBE_LEVELS,
    RECORDS_PER_BUCKET,
    PeerProgress,
    bucket_key,
    bucket_of,
    parse_record,
    read_level,
)


class ValueReader(Protocol):
    """What reading needs of a DHT node (:class:`dht.kademlia.node.DHTNode` has it)."""

    async def get(
        self, key: str, latest: bool = False, *, fresh: bool = False, replicas: int | None = None
    ): ...


def parse_bucket(found: object, level: int, bucket: int, max_samples_per_s: float) -> list:
    """The valid records of bucket ``bucket`` of ``level`` in a DHT answer (``found``)."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return []
    records = []
    for subkey, item in value.items():
        record = parse_record(subkey, item.value, max_samples_per_s)
        if record is not None and bucket_of(record.peer_id, level) == bucket:
            records.append(record)
    return records


async def read_bucket(
    node: ValueReader,
    run_id: str,
    level: int,
    bucket: int,
    max_samples_per_s: float,
    *,
    latest: bool = True,
    replicas: int | None = None,
) -> list[PeerProgress]:
    """The records of one bucket (``latest``: merged from the ``replicas`` closest replicas,
    None: every one; else one replica's, never a cached read: records change every publishing
    interval)."""
    key = bucket_key(run_id, level, bucket)
    extra = {} if replicas is None else {"replicas": replicas}  # readers that lack the option
    found = await node.get(key, latest=latest, fresh=not latest, **extra)
    return parse_bucket(found, level, bucket, max_samples_per_s)


def newest_per_peer(records: Iterable[PeerProgress]) -> list[PeerProgress]:
    """One record per peer, the newest (a peer writes two levels; a stale one may linger)."""
    newest: dict[str, PeerProgress] = {}
    for record in records:
        if record.peer_id not in newest or record.time > newest[record.peer_id].time:
            newest[record.peer_id] = record
    return list(newest.values())


def probe_count(records: Iterable[PeerProgress], own_id: str, level: int) -> float:
    """The swarm's size by the own bucket at ``level`` alone: the others found there, scaled
    up to the layout (a lone record above level 0 says nothing: one stray record at level 8
    would make a swarm of 257)."""
    num_others = len({r.peer_id for r in records} - {own_id})
    if level and num_others < 2:
        return 1.0
    return float(num_others * 2**level + 1)


def levels_beside(level: int) -> tuple[int, ...]:
    """The levels next to ``level`` (the odd ones beside an even level a probe found fullest)."""
    return tuple(lv for lv in (level - 1, level + 1) if 0 <= lv <= MAX_LEVEL)


async def probe_size(
    node: ValueReader,
    run_id: str,
    own_id: str,
    max_samples_per_s: float,
    *,
    replicas: int | None = None,
) -> float:
    """The swarm's size as a newcomer first sees it: the own bucket at every other level (each
    peer writes two neighbouring levels, so one of them holds it), then at the two levels
    beside the fullest, at the level where that counts most (:func:`probe_count`). The odd
    levels matter while the swarm moves to a new layout: its peers then share an odd level,
    and their even ones are split between the old layout and the new (probing the even ones
    only, a newcomer counted 65 of about 180). Each bucket is merged from its ``replicas``
    closest replicas (None: every one), as :func:`read_bucket`'s."""

    async def count(levels: Sequence[int]) -> dict[int, float]:
        found = await asyncio.gather(
            *(
                read_bucket(
                    node,
                    run_id,
                    level,
                    bucket_of(own_id, level),
                    max_samples_per_s,
                    replicas=replicas,
                )
                for level in levels
            )
        )
        return {lv: probe_count(rs, own_id, lv) for lv, rs in zip(levels, found, strict=True)}

    sizes = await count(PROBE_LEVELS)
    sizes |= await count(levels_beside(max(sizes, key=sizes.__getitem__)))
    return max(sizes.values())


class ProgressSweep:
    """Reads every peer's record, bucket by bucket, for a reader that must show all of them.

    A sweep that has no count to go by (the first, or the last found nobody) finds the layout as
    a newcomer peer does (:func:`probe_size`: one bucket at every other level, then the odd
    levels beside the fullest, a filled one saying ``fill * 2**level`` peers); the next ones
    read at the level the last count calls for, and at the levels on either side of it, keeping
    each peer's newest record. Peers write the two levels their own estimate of the swarm calls
    for, which need not be the sweep's: reading one level, the dashboard of 32 peers on a loaded
    host showed records tens of seconds old from a level the peers had left, and at other times
    none at all. A sweep costs 3.5 times the keys of one level.

    Args:
        run_id: the run whose records to read.
        max_samples_per_s: the largest believable rate (larger claims are clamped).
        records_per_bucket: the fill the run's peers aim for
            (``ProgressConfig.records_per_bucket``).
        max_in_flight: gets in flight at once.
        max_latest_buckets: sweeps of more keys than this (the three levels' buckets together)
            read one replica per bucket (``latest=False``: cheaper; a replica that missed a
            store misses that record).
    """

    def __init__(
        self,
        run_id: str,
        *,
        max_samples_per_s: float,
        records_per_bucket: int = RECORDS_PER_BUCKET,
        max_in_flight: int = 32,
        max_latest_buckets: int = 64,
    ):
        self.run_id = run_id
        self.max_samples_per_s = max_samples_per_s
        self.records_per_bucket = records_per_bucket
        self.max_in_flight = max_in_flight
        self.max_latest_buckets = max_latest_buckets
        self.num_peers: int | None = None  # counted by the last sweep
        self.level = 0

    async def _find_level(self, node: ValueReader) -> int:
        # probed as a newcomer peer probes (the odd levels too, while the swarm moves between
        # layouts); the sweep writes no record, so no own id is left out of the counts
        size = await probe_size(node, self.run_id, "", self.max_samples_per_s)
        return read_level(size, self.records_per_bucket)

    async def read(self, node: ValueReader) -> list[PeerProgress]:
        """Every peer's newest record (raises what ``node.get`` raises)."""
        if not self.num_peers:  # first sweep, or nobody last time: where is everyone?
            self.level = await self._find_level(node)
        else:
            self.level = read_level(self.num_peers, self.records_per_bucket)
        keys = [(lv, b) for lv in levels_around(self.level) for b in range(2**lv)]
        latest = len(keys) <= self.max_latest_buckets
        gate = asyncio.Semaphore(self.max_in_flight)

        async def one(level: int, bucket: int) -> list[PeerProgress]:
            async with gate:
                return await read_bucket(
                    node, self.run_id, level, bucket, self.max_samples_per_s, latest=latest
                )

        found = await asyncio.gather(*(one(lv, b) for lv, b in keys))
        records = newest_per_peer(r for bucket in found for r in bucket)
        self.num_peers = len(records)
        return records
