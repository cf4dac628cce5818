"""A peer that settled in a layout nobody else writes (a probe that counted few, a read of an
empty layout) finds the swarm again by probing every level now and then, over a real DHT."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest

import peer.swarm.progress_sample as sample_module
from dht.config import DHTConfig
from dht.identity import PeerIdentity
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.records.progress import bucket_of
from peer.records.progress_read import probe_count
from peer.swarm.progress import ProgressConfig, ProgressTracker
from peer.swarm.progress_sample import reprobe_needed

pytestmark = pytest.mark.timeout(90)

NUM_PEERS = 8
# 8 peers at 4 records a bucket: they write levels 1 and 2 and read level 1 (both buckets)
CONFIG = ProgressConfig(
    target_batch_size=1_000_000, publish_interval_s=0.3, record_ttl_s=2.0, records_per_bucket=4
)


def test_a_probe_level_with_one_record_says_nothing_and_an_empty_layout_calls_for_a_probe():
    assert probe_count([], "me", 0) == 1.0
    assert probe_count([], "me", 4) == 1.0
    others = [type("R", (), {"peer_id": str(i)})() for i in range(3)]
    assert probe_count(others[:1], "me", 0) == 2.0  # a swarm of two at level 0
    assert probe_count(others[:1], "me", 8) == 1.0  # not 257: one stray record
    assert probe_count(others, "me", 4) == 3 * 16 + 1
    # a read of level 4 that counts what level 2 holds: that layout is not in use
    assert reprobe_needed(4, 40.0, 16, None)
    assert not reprobe_needed(4, 150.0, 16, None)
    assert not reprobe_needed(1, 1.0, 16, None)
    # a read that counts half the estimate or less: the swarm may have moved on
    assert reprobe_needed(3, 76.0, 16, 175.0)
    assert not reprobe_needed(3, 150.0, 16, 175.0)


def _identities() -> list[PeerIdentity]:
    """``NUM_PEERS`` identities, half of them in the last one's bucket at level 1: its probe
    then counts the swarm within a factor sqrt(2), as a bucket of a real layout (16 records)
    mostly does."""
    stuck = PeerIdentity.generate()
    mine = bucket_of(stuck.peer_id, 1)
    wanted = {True: NUM_PEERS // 2, False: NUM_PEERS - NUM_PEERS // 2}
    others: list[PeerIdentity] = []
    while len(others) < NUM_PEERS:
        identity = PeerIdentity.generate()
        shares = bucket_of(identity.peer_id, 1) == mine
        if wanted[shares]:
            wanted[shares] -= 1
            others.append(identity)
    return [*others, stuck]


async def test_a_peer_stuck_in_a_layout_of_its_own_finds_the_swarm(monkeypatch):
    monkeypatch.setattr(sample_module, "REPROBE_EVERY_READS", 3)
    identities = _identities()
    async with AsyncExitStack() as stack:
        nodes = []
        for identity in identities:
            initial = [nodes[0].address] if nodes else []
            config = DHTConfig(initial_peers=initial)
            nodes.append(
                await stack.enter_async_context(open_node(identity, TransportConfig(), config))
            )
        trackers = [ProgressTracker(dht=node, prefix="run", config=CONFIG) for node in nodes]
        for tracker in trackers:
            tracker.report_local_progress(0, 0)
        for tracker in trackers[:-1]:
            await stack.enter_async_context(tracker)
        deadline = time.monotonic() + 30
        while not all(t.size is not None and t.size >= NUM_PEERS for t in trackers[:-1]):
            assert time.monotonic() < deadline, [t.size for t in trackers]
            await asyncio.sleep(0.3)
        await asyncio.sleep(2.5)  # the records of their first, smaller layouts expire
        # the last one starts out sure it is alone (as after a failed probe): it writes and
        # reads level 0, which nobody else writes; without a new probe it stayed a swarm of one
        stuck = trackers[-1]
        stuck._size.update(1.0, time.monotonic(), exact=True)
        await stack.enter_async_context(stuck)
        deadline = time.monotonic() + 30
        while (stuck.size or 0) < NUM_PEERS:
            assert time.monotonic() < deadline, stuck.size
            await asyncio.sleep(0.3)
        view = await stuck.refresh()
    assert view.num_peers == NUM_PEERS + 1
