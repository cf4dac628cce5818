"""A progress record is stored when readers would learn something from it, not every interval."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import AsyncExitStack

import pytest

from dht.config import get_dht_time
from dht.errors import ConfigError
from peer.records.progress import PeerProgress
from peer.swarm.progress import ProgressConfig, ProgressTracker
from peer.swarm.progress_schedule import publish_due, read_interval_s, record_lifetime_s
from tests.peer.swarm.test_progress import start_nodes

pytestmark = pytest.mark.timeout(60)

CONFIG = ProgressConfig(target_batch_size=10_000, publish_interval_s=2.0, max_publish_gap_s=5.0)
LEVELS = (2, 3)


def line(epoch: int, samples: float, rate: float, time: float) -> PeerProgress:
    return PeerProgress("ab" * 32, epoch, int(samples), rate, time, None, False)


def test_a_steady_peer_is_stored_once_per_gap_and_any_change_at_the_next_interval():
    stored = line(3, 100, 50.0, time=1000.0)
    last = (stored, LEVELS, 10.0)
    steady = line(3, 100 + 50 * 2.0, 50.0, time=1002.0)  # on the stored line, 2 s later
    assert not publish_due(last, steady, LEVELS, 12.0, CONFIG)
    assert not publish_due(last, line(3, 100 + 50 * 3.0, 50.0, 1003.0), LEVELS, 13.0, CONFIG)
    # the next tick (16 s) would be past the 5-s gap: stored at this one
    assert publish_due(last, line(3, 100 + 50 * 4.0, 50.0, 1004.0), LEVELS, 14.0, CONFIG)
    # half an interval's samples off the line (50 samples at 50/s): stored
    assert publish_due(last, line(3, 100 + 50 * 2.0 - 60, 50.0, 1002.0), LEVELS, 12.0, CONFIG)
    assert not publish_due(last, line(3, 100 + 50 * 2.0 - 40, 50.0, 1002.0), LEVELS, 12.0, CONFIG)
    # a rate half again off: stored at once; a smaller change once the line is off
    assert publish_due(last, line(3, 200, 20.0, 1002.0), LEVELS, 12.0, CONFIG)
    assert not publish_due(last, line(3, 200, 40.0, 1002.0), LEVELS, 12.0, CONFIG)
    # a new epoch, other levels, nothing stored yet: stored
    assert publish_due(last, line(4, 0, 50.0, 1002.0), LEVELS, 12.0, CONFIG)
    assert publish_due(last, steady, (3, 4), 12.0, CONFIG)
    assert publish_due(None, steady, LEVELS, 12.0, CONFIG)


def test_a_gap_no_longer_than_an_interval_stores_every_interval():
    every = ProgressConfig(target_batch_size=10_000, publish_interval_s=2.0, max_publish_gap_s=2.0)
    last = (line(3, 100, 50.0, 1000.0), LEVELS, 10.0)
    assert publish_due(last, line(3, 150, 50.0, 1001.0), LEVELS, 11.0, every)
    # the gap is bounded by the record's lifetime: a short-lived record is stored in time
    short = ProgressConfig(
        target_batch_size=10, publish_interval_s=0.1, record_ttl_s=0.5, max_publish_gap_s=5.0
    )
    assert short.publish_gap_s == 0.25
    # None: every interval
    assert ProgressConfig(target_batch_size=10, max_publish_gap_s=None).publish_gap_s == 2.0
    off = ProgressConfig(target_batch_size=10_000, max_publish_gap_s=None)
    assert publish_due(last, line(3, 150, 50.0, 1001.0), LEVELS, 11.0, off)
    # on by default: 5 s (half the extrapolation bound), so this steady peer is not stored yet
    default = ProgressConfig(target_batch_size=10_000)
    assert default.publish_gap_s == 5.0
    assert not publish_due(last, line(3, 150, 50.0, 1001.0), LEVELS, 11.0, default)


async def test_readers_follow_a_steady_peer_stored_every_few_intervals_and_see_its_epoch_at_once():
    config = ProgressConfig(
        target_batch_size=1_000_000, publish_interval_s=0.1, record_ttl_s=5, max_publish_gap_s=1.0
    )
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, 2)
        worker = await stack.enter_async_context(
            ProgressTracker(dht=nodes[0], prefix="run", config=config)
        )
        reader = ProgressTracker(dht=nodes[1], prefix="run", config=config)
        rate_per_s, start = 1000.0, get_dht_time()
        errors = []
        for step in range(1, 31):  # 3 s of steady training, a report every 0.1 s
            await asyncio.sleep(0.1)
            worker.report_local_progress(0, int(rate_per_s * (get_dht_time() - start)))
            if step >= 10 and step % 5 == 0:
                view = await reader.refresh()
                truth = rate_per_s * (get_dht_time() - start)
                seen = view.samples_accumulated  # the reader's own count is 0
                errors.append(abs(seen - truth) / truth)
        num_stored = next(iter(worker._owned.values())).num_published
        worker.report_local_progress(1, 0)
        await asyncio.sleep(0.5)  # a few intervals (on a loaded host, ticks run late)
        deadline = asyncio.get_running_loop().time() + 10
        while (await reader.refresh()).epoch != 1:
            assert asyncio.get_running_loop().time() < deadline
    # about one store per 1-s gap, not one per 0.1-s interval (30 ticks)
    assert num_stored <= 12, num_stored
    # readers extrapolate the stored line: within half an interval's samples of the truth,
    # plus the rate's smoothing at the start
    assert max(errors) < 0.1, errors


def test_a_record_outlives_three_refresh_cycles_of_a_busy_publisher_within_a_bound():
    config = ProgressConfig(target_batch_size=10, publish_interval_s=2.0, record_ttl_s=20.0)
    assert record_lifetime_s([], config) == 20.0
    assert record_lifetime_s([2.5, 3.0], config) == 20.0  # a quiet host: the configured lifetime
    assert record_lifetime_s([9.0, 21.0, 15.0], config) == 63.0  # the longest of the cycles
    assert record_lifetime_s([500.0], config) == 200.0  # a vanished peer still drops out


async def test_a_publisher_whose_refresh_cycle_outlasts_the_record_ttl_stays_seen():
    # the publisher's reads take 1.5 s (a busy host's DHT): a cycle of ~1.7 s, past the 1-s TTL
    config = ProgressConfig(target_batch_size=1_000_000, publish_interval_s=0.2, record_ttl_s=1.0)
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, 2)
        busy = ProgressTracker(dht=nodes[0], prefix="run", config=config)
        read_records = busy._read_records

        async def slow_read():
            await asyncio.sleep(1.5)
            return await read_records()

        busy._read_records = slow_read
        busy.report_local_progress(0, 0)
        await stack.enter_async_context(busy)
        reader = ProgressTracker(dht=nodes[1], prefix="run", config=config)
        await asyncio.sleep(2.0)  # its first cycle is measured from the second publish on
        counts = []
        for _ in range(12):  # 3.6 s: about two of its cycles, reads at every phase of them
            counts.append((await reader.refresh()).num_peers)
            await asyncio.sleep(0.3)
    # with the configured 1-s lifetime, a third of the reads fell between its record's
    # expiry and its refresh and counted a swarm of one
    assert counts == [2] * len(counts), counts


def test_a_read_of_more_keys_than_an_interval_allows_comes_every_few_intervals():
    config = ProgressConfig(target_batch_size=10, publish_interval_s=2.0)
    assert config.max_keys_read_per_interval == 2
    # 8 keys: every 5 s, not 8: a record read is up to 5 s old (the publish gap) and must not
    # outgrow the 10-s extrapolation bound before the next read
    assert [read_interval_s(n, config) for n in (0, 1, 2, 4, 8)] == [2.0, 2.0, 2.0, 4.0, 5.0]
    assert config.max_extrapolation_s - config.publish_gap_s == 5.0
    every = ProgressConfig(target_batch_size=10, max_keys_read_per_interval=None)
    assert read_interval_s(8, every) == 2.0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="max_keys_read_per_interval"):
            ProgressConfig(target_batch_size=10, max_keys_read_per_interval=bad)


async def test_a_tracker_whose_reads_take_four_keys_reads_at_every_other_tick():
    config = ProgressConfig(target_batch_size=1_000_000, publish_interval_s=0.2)
    async with AsyncExitStack() as stack:
        (node,) = await start_nodes(stack, 1)
        tracker = ProgressTracker(dht=node, prefix="run", config=config)
        publish, read_records = tracker._publish, tracker._read_records
        ticks, reads = [], []

        async def counted_publish():
            ticks.append(asyncio.get_running_loop().time())
            return await publish()

        async def four_keys():
            reads.append(asyncio.get_running_loop().time())
            found = await read_records()
            tracker.num_keys_read = 4  # a layout sampled with four keys (64 peers or so)
            return found

        tracker._publish, tracker._read_records = counted_publish, four_keys
        await stack.enter_async_context(tracker)
        for _ in range(200):
            if len(reads) >= 4:
                break
            await asyncio.sleep(0.05)
        gaps = [b - a for a, b in itertools.pairwise(reads)]
        # every 0.4 s (ticks come an interval after the last ended: half an interval early)
        assert len(reads) >= 4 and min(gaps) >= 0.3 - 0.01, gaps
        assert len(ticks) > len(reads)
        num_reads = len(reads)
        await tracker.refresh()  # a read asked for comes at once
        assert len(reads) == num_reads + 1
