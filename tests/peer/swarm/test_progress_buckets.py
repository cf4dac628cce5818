"""Bucketed progress over a real DHT on loopback: 40 peers, a layout of 8 buckets and more, each
peer reading 4 of them per refresh; the estimate checked against the exact sum of every peer's
samples, a stranger's records in a peer's own bucket, and the reads' bound."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
from contextlib import AsyncExitStack

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.config import DHTConfig, get_dht_time
from dht.identity import PeerIdentity
from dht.kademlia.validation import owner_subkey
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.records.progress import bucket_key, bucket_of, read_level, write_levels
from peer.records.progress_read import ProgressSweep
from peer.swarm.progress import ProgressConfig, ProgressTracker

pytestmark = pytest.mark.timeout(110)
NUM_PEERS = 40
EPOCH = 3
# 4 records a bucket: 40 peers read at level 3 (8 buckets), 4 buckets a read
CONFIG = ProgressConfig(
    target_batch_size=40_000,
    publish_interval_s=1.0,
    record_ttl_s=60.0,
    records_per_bucket=4,
    max_buckets_read=4,
    max_partner_buckets=1,
)
# the estimate of the swarm's samples, against the exact sum: the median peer within 25%, nine
# in ten within 60%, every one within a factor 2 (4 of 8 buckets of about 5 records, 3 drawn at
# random: the size is a sample of about 15 records per read, averaged over 4 reads; the
# simulation, with buckets of 16, gives the figures of a real layout)
MEDIAN_ERROR = 0.25
P90_ERROR = 0.6
MAX_ERROR = 1.0
# each peer's samples where a stranger claims a billion
SAMPLES_PER_PEER = 250


def dht_config(initial_peers: list[str]) -> DHTConfig:
    # 5 replicas a key, not 20: 40 nodes in one process on a loaded machine stay quick
    return DHTConfig(initial_peers=initial_peers, bucket_size=5)


def fixed_identity(index: int) -> PeerIdentity:
    """The same key each run: the peers' buckets, and so which records a sample of buckets
    holds, are then one layout rather than a new draw per run, whose tail the estimate's
    bounds below would have to cover (the simulation measures the spread over layouts)."""
    seed = hashlib.sha256(f"test-progress-buckets-{index}".encode()).digest()
    return PeerIdentity(Ed25519PrivateKey.from_private_bytes(seed))


async def start_nodes(stack: AsyncExitStack, num_nodes: int, *, fixed: bool = False) -> list:
    nodes = []
    for index in range(num_nodes):
        initial = [nodes[i].address for i in range(min(index, 3))]
        identity = fixed_identity(index) if fixed else PeerIdentity.generate()
        nodes.append(
            await stack.enter_async_context(
                open_node(identity, TransportConfig(), dht_config(initial))
            )
        )
    return nodes


# refreshes in flight at once: 40 peers' first reads sweep 9 levels each, and all of them on
# this one event loop at once missed the DHT's 5-s RPC timeout on a loaded CI host (every get
# "no node answered", the test past its timeout); 40 real peers have 40 loops
MAX_CONCURRENT_REFRESHES = 8


async def refresh_all(trackers: list[ProgressTracker], rounds: int) -> None:
    slots = asyncio.Semaphore(MAX_CONCURRENT_REFRESHES)

    async def refresh(tracker: ProgressTracker) -> None:
        async with slots:
            await tracker.refresh()

    for _ in range(rounds):
        await asyncio.gather(*(refresh(tracker) for tracker in trackers))


def relative_error(estimate: float, truth: float) -> float:
    return abs(estimate - truth) / truth


@pytest.mark.timeout(180)  # 69 s in a loaded CI run with four reads at 40
async def test_forty_peers_estimate_the_swarm_from_a_bounded_sample():
    """The swarm grows from 10 to 40 peers (one bucket read whole, then a sample of 8 buckets
    and more): the keys and records read per refresh stay bounded, and the estimate at 40 is
    checked against the exact sum of every peer's samples."""
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, NUM_PEERS, fixed=True)
        trackers = [
            ProgressTracker(dht=node, prefix="run", config=CONFIG, seed=i)
            for i, node in enumerate(nodes)
        ]
        samples = [100 + 10 * i for i in range(NUM_PEERS)]  # one report each: rate 0, no drift
        seen = {}
        for size, rounds in ((10, 1), (20, 2), (40, 4)):
            for tracker, count in zip(trackers[:size], samples, strict=False):
                tracker.report_local_progress(EPOCH, count)
            await refresh_all(trackers[:size], rounds)
            seen[size] = statistics.mean(len(t.current().peers) for t in trackers[:size])
            assert all(t.num_keys_read <= CONFIG.max_buckets_read for t in trackers[:size])
        # a whole small swarm, then a sample of a larger one: not many more records per read
        assert seen[40] <= 1.5 * seen[20], seen
        views = [tracker.current() for tracker in trackers]
        # the layout: 8 buckets and more, none read whole; the size is a mean over its window,
        # which still holds the reads at 20, so a peer whose reads at 40 came out low may still
        # read the 4 buckets of level 2 whole (one in a CI run; six reads at 40 instead pushed
        # more peers to sample level 3, and the largest error past its bound)
        levels = [read_level(t.size, CONFIG.records_per_bucket) for t in trackers]
        assert sum(level >= 3 for level in levels) >= 0.9 * NUM_PEERS, levels
        # ... and those few read level 2 whole, with no sample (a loaded CI run had one)
        assert sum(t._sample is not None for t in trackers) >= 0.9 * NUM_PEERS
        assert all(t.num_keys_read <= CONFIG.max_buckets_read for t in trackers)
        # each saw a part of the swarm, and estimated the whole
        assert statistics.median(len(v.peers) for v in views) < 0.8 * NUM_PEERS
        truth = sum(samples)
        errors = [relative_error(v.samples_accumulated, truth) for v in views]
        assert statistics.median(errors) <= MEDIAN_ERROR, sorted(errors)
        assert sorted(errors)[int(0.9 * len(errors))] <= P90_ERROR, sorted(errors)
        assert max(errors) <= MAX_ERROR, sorted(errors)
        sizes = [relative_error(v.num_peers, NUM_PEERS) for v in views]
        assert statistics.median(sizes) <= MEDIAN_ERROR, sorted(sizes)
        assert all(v.epoch == EPOCH and v.num_at(EPOCH) == v.num_peers for v in views)
        # the dashboard reads every bucket and sees every peer
        sweep = ProgressSweep(
            "run",
            max_samples_per_s=CONFIG.max_samples_per_s,
            records_per_bucket=CONFIG.records_per_bucket,
        )
        seen = await sweep.read(nodes[0])
        seen = await sweep.read(nodes[0])  # the second at the level the first counted
        assert {r.peer_id for r in seen} == {node.peer_id for node in nodes}
        assert sum(r.samples for r in seen) == truth


@pytest.mark.timeout(180)  # 90 s in a loaded CI run (20 s on an idle host)
async def test_a_strangers_record_in_the_own_bucket_cannot_end_the_epoch():
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, NUM_PEERS)
        trackers = [
            ProgressTracker(dht=node, prefix="run", config=CONFIG, seed=i)
            for i, node in enumerate(nodes)
        ]
        for tracker in trackers:
            # 40 x 250, a quarter of the target: the estimate of this sample of buckets can
            # run 1.6x over (65 peers counted of 40, seen on a busy host), and the claim's
            # bound adds 4 x 250 x the weight of a record (8 here) on top, still short of it
            tracker.report_local_progress(EPOCH, SAMPLES_PER_PEER)
        await refresh_all(trackers, 4)
        victim = trackers[0]
        partners = [node.peer_id for node in nodes[1:9]]
        victim.note_round(EPOCH, partners)
        honest = (await victim.refresh()).samples_accumulated
        # a stranger (its own key and node, ground to hash into the victim's bucket at the
        # levels read and written) claims a billion samples in the victim's own bucket. At
        # every level of 4 to 16 buckets too: the victim's size estimate is a sample that moves
        # (33 to 46 of these 40 peers, seen on a busy host), and a read at a level the claim
        # is not in would test nothing
        level = read_level(victim.size, CONFIG.records_per_bucket)
        levels = {2, 3, 4, level, *write_levels(victim.size, CONFIG.records_per_bucket)}
        identity = PeerIdentity.generate()
        while any(
            bucket_of(identity.peer_id, lv) != bucket_of(victim.dht.peer_id, lv) for lv in levels
        ):
            identity = PeerIdentity.generate()
        stranger = await stack.enter_async_context(
            open_node(identity, TransportConfig(), dht_config([nodes[0].address]))
        )
        claim = {"epoch": EPOCH, "samples": 10**9, "samples_per_s": 1e6, "time": get_dht_time()}
        for lv in levels:
            assert await stranger.store(
                bucket_key("run", lv, bucket_of(identity.peer_id, lv)),
                claim,
                get_dht_time() + 60,
                subkey=owner_subkey(identity.peer_id),
            )
        views = []
        # Six views that hold the claim, at most 20 taken: on a busy host a view came back
        # without it now and then (seen, cause not pinned down), and a view without the claim
        # tests nothing (each one is still held to the bound below).
        seen = 0
        while seen < 6 and len(views) < 20:
            views.append(await victim.refresh())
            seen += identity.peer_id in {p.peer_id for p in views[-1].peers}
        assert seen == 6, f"the claim was in {seen} of {len(views)} views"
        assert not any(view.ready for view in views)
        # a stranger seen counts at most max_stranger_claim_ratio x the partners' mean
        # times its weight (the peers each drawn record stands for)
        for view in views:
            weight = max(view.weights or (1.0,))
            bound = CONFIG.max_stranger_claim_ratio * SAMPLES_PER_PEER * weight
            most = max(honest, SAMPLES_PER_PEER * view.num_peers) + bound + 1
            assert view.samples_accumulated <= most
