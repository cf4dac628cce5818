"""The dashboard's sweep of the progress buckets over a real DHT on loopback: it shows each peer's
newest record, also when the peers write levels other than the one its own count calls for.

Peers write the two levels their estimate of the swarm's size calls for, and a record left at a
level a peer no longer writes lingers until it expires. Reading only the level of its own count,
the dashboard of 32 `peer join` peers on a loaded host showed records tens of seconds old.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from dht.config import DHTConfig, get_dht_time
from dht.identity import PeerIdentity
from dht.kademlia.validation import owner_subkey
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.records.progress import bucket_key, bucket_of, read_level
from peer.records.progress_read import ProgressSweep

pytestmark = pytest.mark.timeout(60)
NUM_PEERS = 12
RECORDS_PER_BUCKET = 8  # the sweep counts 12 peers: level 1, where the records are old
OLD_LEVEL, NEW_LEVELS = 1, (2, 3)  # the peers counted the swarm larger since


def _record(node, epoch: int, time_s: float) -> dict:
    return {
        "epoch": epoch,
        "samples": 10 * epoch,
        "samples_per_s": 100.0,
        "time": time_s,
        "address": node.address,
        "client_mode": False,
    }


async def _store(node, level: int, value: dict) -> None:
    key = bucket_key("run", level, bucket_of(node.peer_id, level))
    stored = await node.store(key, value, get_dht_time() + 60.0, subkey=owner_subkey(node.peer_id))
    assert stored


async def test_the_sweep_shows_each_peers_newest_record_whatever_levels_they_write():
    assert read_level(NUM_PEERS, RECORDS_PER_BUCKET) == OLD_LEVEL
    async with AsyncExitStack() as stack:
        nodes = []
        for index in range(NUM_PEERS):
            initial = [nodes[i].address for i in range(min(index, 3))]
            config = DHTConfig(initial_peers=initial, bucket_size=5)
            identity = PeerIdentity.generate()
            nodes.append(
                await stack.enter_async_context(open_node(identity, TransportConfig(), config))
            )
        now = get_dht_time()
        for node in nodes:
            await _store(node, OLD_LEVEL, _record(node, epoch=1, time_s=now - 30.0))
            for level in NEW_LEVELS:
                await _store(node, level, _record(node, epoch=5, time_s=now))
        reader = nodes[0]
        sweep = ProgressSweep("run", max_samples_per_s=1e6, records_per_bucket=RECORDS_PER_BUCKET)

        await sweep.read(reader)  # the first finds the layout; the next read at its count
        seen = await sweep.read(reader)

        assert sweep.level == OLD_LEVEL
        assert {r.peer_id for r in seen} == {node.peer_id for node in nodes}
        # before: the records of level 1 alone, epoch 1 and 30 s old
        assert {r.epoch for r in seen} == {5}
