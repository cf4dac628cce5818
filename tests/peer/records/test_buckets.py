"""Bucketed per-peer records over a real DHT on loopback: publishers that count the swarm
differently (within a factor 2 of the reader) are all found, each in one bucket; a stranger's
record filed under a bucket its id does not hash to is dropped; no key grows with the swarm."""

from __future__ import annotations

import asyncio
import random
from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest

from dht.config import DHTConfig, get_dht_time
from dht.identity import PeerIdentity
from dht.kademlia.validation import owner_subkey
from dht.launch import open_node
from dht.net.config import TransportConfig
from dht.owned_record import OwnedRecord
from peer.records.buckets import (
    bucket_key,
    bucket_keys,
    read_every_record,
    read_levels,
    record_key,
    sample_bucket_keys,
    write_level,
)
from peer.records.progress import bucket_of
from peer.records.schema import owner_of

pytestmark = pytest.mark.timeout(110)
NUM_PEERS = 24
RECORDS_PER_BUCKET = 2  # 24 peers: level 4 (16 buckets), so the layout is exercised
PREFIX = "run/kind"


def parse(subkey: object, value: object):
    peer_id = owner_of(subkey)
    if peer_id is None or not isinstance(value, dict) or not isinstance(value.get("n"), int):
        return None
    return SimpleNamespace(peer_id=peer_id, time=float(value["time"]), n=value["n"])


def test_readers_and_writers_within_a_factor_2_meet():
    for reader in (1, 3, 24, 100, 5000, 10**6):
        levels = read_levels(reader, RECORDS_PER_BUCKET)
        for ratio in (0.5, 0.71, 1.0, 1.41, 1.99):
            assert write_level(reader * ratio, RECORDS_PER_BUCKET) in levels, (reader, ratio)
    assert [k for _, _, k in bucket_keys(PREFIX, (0, 1))] == ["run/kind/0/0", "run/kind/1/0",
                                                              "run/kind/1/1"]  # fmt: skip
    with pytest.raises(ValueError, match="no bucket 2 at level 1"):
        bucket_key(PREFIX, 1, 2)


async def test_every_publisher_is_found_once_and_a_misfiled_record_is_dropped():
    rng = random.Random(5)
    async with AsyncExitStack() as stack:
        nodes = []
        for index in range(NUM_PEERS + 1):  # the last one is a stranger
            initial = [nodes[i].address for i in range(min(index, 3))]
            config = DHTConfig(initial_peers=initial, bucket_size=5)
            nodes.append(
                await stack.enter_async_context(
                    open_node(PeerIdentity.generate(), TransportConfig(), config)
                )
            )
        peers, stranger = nodes[:NUM_PEERS], nodes[NUM_PEERS]
        # each publisher counts the swarm somewhere between half and twice its true size
        counts = {node.peer_id: NUM_PEERS * 2 ** rng.uniform(-0.99, 0.99) for node in peers}
        for round_n in (1, 2):  # the second value replaces the first (newest per peer)
            records = [
                OwnedRecord(
                    dht=node,
                    key=lambda node=node: record_key(
                        PREFIX, node.peer_id, counts[node.peer_id], RECORDS_PER_BUCKET
                    ),
                    make_value=lambda now, n=round_n: ({"n": n, "time": now}, now),
                    ttl_s=60.0,
                    interval_s=None,
                    name="test record",
                )
                for node in peers
            ]
            assert all(await asyncio.gather(*(r.publish() for r in records)))
        # the stranger files its record where its id does not belong, at the reader's level
        level = read_levels(NUM_PEERS, RECORDS_PER_BUCKET)[1]
        wrong = (bucket_of(stranger.peer_id, level) + 1) % 2**level
        now = get_dht_time()
        assert await stranger.store(
            bucket_key(PREFIX, level, wrong), {"n": 2, "time": now}, now + 60,
            subkey=owner_subkey(stranger.peer_id),
        )  # fmt: skip

        found = await read_every_record(
            stranger, PREFIX, num_peers=NUM_PEERS, records_per_bucket=RECORDS_PER_BUCKET,
            parse=parse,
        )  # fmt: skip
        assert sorted(r.peer_id for r in found) == sorted(counts)
        assert all(r.n == 2 for r in found)
        # no key holds much more than its share: 24 records over 8 to 32 buckets
        sizes = []
        for _, _, key in bucket_keys(PREFIX, read_levels(NUM_PEERS, RECORDS_PER_BUCKET)):
            value = getattr(await stranger.get(key, latest=True), "value", None)
            sizes.append(len(value) if isinstance(value, dict) else 0)
        assert sum(sizes) == NUM_PEERS + 1 and max(sizes) <= 4 * RECORDS_PER_BUCKET


def test_a_sample_reads_the_anchors_buckets_and_a_few_more_whatever_the_swarm():
    rng = random.Random(1)
    anchors = [f"peer-{i}" for i in range(17)]  # this peer and a group's partners
    small = sample_bucket_keys(PREFIX, num_peers=20, records_per_bucket=32, anchors=anchors,
                               num_random=2, rng=rng)  # fmt: skip
    assert small == bucket_keys(PREFIX, read_levels(20, 32))  # a small layout: read whole
    for num_peers in (10_000, 10**6):
        keys = sample_bucket_keys(PREFIX, num_peers=num_peers, records_per_bucket=32,
                                  anchors=anchors, num_random=2, rng=rng)  # fmt: skip
        assert len(keys) <= 4 * (len(anchors) + 2)
        level = read_levels(num_peers, 32)[1]
        read = {(lv, b) for lv, b, _ in keys}
        for anchor in anchors:  # every publisher level an anchor may write at is read
            for lv in read_levels(num_peers, 32):
                assert (lv, bucket_of(anchor, lv)) in read, (num_peers, anchor, lv)
        anchored = {bucket_of(anchor, level) for anchor in anchors}
        assert len({b for lv, b, _ in keys if lv == level}) == len(anchored) + 2
