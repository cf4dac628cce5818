"""Per-peer records spread over buckets, so that no key and no read grows with the swarm.

Each peer of a run publishes one profile record and one round record (and the dashboard reads
them all). Under one key per run, a 10,000-peer swarm would push that key past its cap and make
the ~20 nodes closest to it serve every store. Like progress (:mod:`peer.records.progress`), a
record lives under ``{run_id}/{kind}/{level}/{bucket}``: ``2**level`` buckets, ``bucket`` the
top ``level`` bits of ``sha256(peer id)`` (:func:`peer.records.progress.bucket_of`), ``level``
the one that puts about ``records_per_bucket`` records in a bucket for the publisher's estimate
of the swarm's size (:func:`write_level`).

Nobody but the dashboard reads every record, so a publisher writes one level, and the reader
reads the three around its own estimate (:func:`read_levels`): estimates within a factor 2 of
each other meet. A record found under a bucket its owner does not hash to is dropped (a stranger
cannot file records where they count twice). Torch-free, like everything in
:mod:`peer.records`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from peer.records.progress import MAX_LEVEL, bucket_of, read_level


class ValueReader(Protocol):
    """What reading needs of a DHT node (:class:`dht.kademlia.node.DHTNode` has it)."""

    async def get(self, key: str, latest: bool = False): ...


def bucket_key(prefix: str, level: int, bucket: int) -> str:
    """The key of bucket ``bucket`` of layout ``level`` under ``prefix`` (``{run}/{kind}``)."""
    if not 0 <= level <= MAX_LEVEL or not 0 <= bucket < 2**level:
        raise ValueError(f"no bucket {bucket} at level {level}")
    return f"{prefix}/{level}/{bucket}"


def write_level(num_peers: float, records_per_bucket: int) -> int:
    """The level a publisher that counts ``num_peers`` peers writes at."""
    return read_level(num_peers, records_per_bucket)


def record_key(prefix: str, peer_id: str, num_peers: float, records_per_bucket: int) -> str:
    """Where ``peer_id`` publishes its record when it counts ``num_peers`` peers."""
    level = write_level(num_peers, records_per_bucket)
    return bucket_key(prefix, level, bucket_of(peer_id, level))


def read_levels(num_peers: float, records_per_bucket: int) -> tuple[int, ...]:
    """The levels a reader that counts ``num_peers`` peers reads (about 3.5 keys per bucket
    it would read at its own level: publishers count the swarm differently)."""
    return levels_around(read_level(num_peers, records_per_bucket))


def levels_around(level: int) -> tuple[int, ...]:
    """``level`` and the levels on either side of it that exist."""
    return tuple(lv for lv in (level - 1, level, level + 1) if 0 <= lv <= MAX_LEVEL)


def bucket_keys(prefix: str, levels: tuple[int, ...]) -> list[tuple[int, int, str]]:
    """``(level, bucket, key)`` of every bucket of ``levels``."""
    return [
        (level, bucket, bucket_key(prefix, level, bucket))
        for level in levels
        for bucket in range(2**level)
    ]


def sample_bucket_keys(
    prefix: str,
    *,
    num_peers: float,
    records_per_bucket: int,
    anchors: Iterable[str],
    num_random: int,
    rng: random.Random,
) -> list[tuple[int, int, str]]:
    """``(level, bucket, key)`` of a bounded sample, for a reader that needs some records.

    The buckets of the reader's level that ``anchors`` hash to (this peer, the peers it must
    find) and ``num_random`` others drawn at random, each with its parent and its two children
    (the levels publishers that count the swarm differently write at): at most four keys a
    bucket, whatever the swarm's size. A layout that small is read whole.
    """
    anchors = list(anchors)
    every = bucket_keys(prefix, read_levels(num_peers, records_per_bucket))
    if len(every) <= 4 * (len(anchors) + num_random):
        return every
    level = read_level(num_peers, records_per_bucket)
    chosen = dict.fromkeys(bucket_of(peer_id, level) for peer_id in anchors)
    rest = [b for b in range(2**level) if b not in chosen]
    chosen.update(dict.fromkeys(rng.sample(rest, min(num_random, len(rest)))))
    picked: dict[tuple[int, int], None] = {}
    for bucket in chosen:
        family = [(level, bucket), (level + 1, 2 * bucket), (level + 1, 2 * bucket + 1)]
        family += [(level - 1, bucket >> 1)] if level > 0 else []
        picked.update((entry, None) for entry in family if entry[0] <= MAX_LEVEL)
    return [(lv, b, bucket_key(prefix, lv, b)) for lv, b in picked]


def owns_bucket(peer_id: str | None, level: int, bucket: int) -> bool:
    """Whether ``peer_id``'s record belongs in bucket ``bucket`` of ``level``."""
    return peer_id is not None and bucket_of(peer_id, level) == bucket


async def read_every_record(
    node: ValueReader,
    prefix: str,
    *,
    num_peers: float,
    records_per_bucket: int,
    parse: Callable[[object, object], Any],
    max_in_flight: int = 32,
    max_latest_buckets: int = 64,
    newest_by: Callable[[Any], float] = lambda record: record.time,
) -> list:
    """Every peer's newest record under ``prefix``, for a reader counting ``num_peers`` peers.

    Args:
        node: the DHT node to read through.
        prefix: ``{run}/{kind}``.
        num_peers: the reader's count of the swarm (picks the levels, :func:`read_levels`).
        records_per_bucket: the kind's layout constant.
        parse: ``(subkey, value) -> record | None``; a record has ``peer_id`` and ``time``.
        max_in_flight: gets in flight at once.
        max_latest_buckets: reads of more buckets than this ask one replica per bucket
            (``latest=False``: cheaper, possibly as old as the node's read cache).
        newest_by: what makes one of a peer's records newer than another.
    """
    keys = bucket_keys(prefix, read_levels(num_peers, records_per_bucket))
    return await read_buckets(
        node,
        keys,
        parse=parse,
        latest=len(keys) <= max_latest_buckets,
        max_in_flight=max_in_flight,
        newest_by=newest_by,
    )


async def read_buckets(
    node: ValueReader,
    keys: list[tuple[int, int, str]],
    *,
    parse: Callable[[object, object], Any],
    latest: bool = True,
    max_in_flight: int = 32,
    newest_by: Callable[[Any], float] = lambda record: record.time,
) -> list:
    """The newest record (by ``newest_by``) of each peer found under ``keys`` (``(level,
    bucket, key)``), each kept only in a bucket its owner hashes to (a peer whose count of the
    swarm changed may have left a record at another level)."""
    gate = asyncio.Semaphore(max_in_flight)

    async def one(level: int, bucket: int, key: str) -> list:
        async with gate:
            found = await node.get(key, latest=latest)
        value = getattr(found, "value", None)
        if not isinstance(value, dict):
            return []
        parsed = (parse(subkey, item.value) for subkey, item in value.items())
        return [r for r in parsed if r is not None and owns_bucket(r.peer_id, level, bucket)]

    found = await asyncio.gather(*(one(*entry) for entry in keys))
    newest: dict[str, Any] = {}
    for record in (r for records in found for r in records):
        if record.peer_id not in newest or newest_by(record) > newest_by(newest[record.peer_id]):
            newest[record.peer_id] = record
    return list(newest.values())
