"""Progress records over a real DHT on loopback, and the swarm estimate from them."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest

import peer.swarm.progress as progress_module
from dht.config import DHTConfig, get_dht_time
from dht.errors import ConfigError
from dht.identity import PeerIdentity
from dht.kademlia.validation import owner_subkey
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.records.progress import PeerProgress, parse_record
from peer.swarm.progress import ProgressConfig, ProgressTracker, estimate

pytestmark = pytest.mark.timeout(60)


async def start_nodes(stack: AsyncExitStack, num_nodes: int) -> list:
    nodes = []
    for _ in range(num_nodes):
        initial = [nodes[0].address] if nodes else []
        nodes.append(
            await stack.enter_async_context(
                open_node(
                    PeerIdentity.generate(), TransportConfig(), DHTConfig(initial_peers=initial)
                )
            )
        )
    return nodes


def record(
    peer: int, epoch: int, samples: int, rate: float = 0.0, age_s: float = 0.0, now: float = 1000.0
) -> PeerProgress:
    return PeerProgress(f"{peer:064x}", epoch, samples, rate, now - age_s, None, False)


async def test_three_peers_see_the_sum_of_their_samples():
    config = ProgressConfig(target_batch_size=1000, publish_interval_s=0.2, record_ttl_s=5)
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, 3)
        trackers = [ProgressTracker(dht=node, prefix="run", config=config) for node in nodes]
        for tracker, samples in zip(trackers, (100, 200, 300), strict=True):
            tracker.report_local_progress(epoch=2, samples=samples)
            await tracker.refresh()
        views = [await tracker.refresh() for tracker in trackers]
    for view in views:
        assert view.epoch == 2 and view.num_peers == 3
        # rates are 0 (one report each), so the estimate is exactly the sum
        assert view.samples_accumulated == 600
        assert not view.ready and math.isinf(view.eta_next_epoch_s)


def test_extrapolation_eta_and_clock_skew():
    config = ProgressConfig(target_batch_size=1000, max_extrapolation_s=10)
    own = record(0, epoch=1, samples=100, rate=50, now=1000)
    others = [
        record(1, 1, 100, rate=50, age_s=2),  # 100 + 50 * 2
        record(2, 1, 100, rate=50, age_s=-30),  # a clock 30 s ahead: counted as age 0
        record(3, 1, 100, rate=50, age_s=3600),  # stale beyond the bound: 10 s at most
    ]
    view = estimate(others, own=own, config=config, now=1000.0)
    assert view.samples_accumulated == 100 + 200 + 100 + 600
    assert view.samples_per_s == 200
    assert view.eta_next_epoch_s == pytest.approx(0.0)
    assert view.ready


def test_one_peer_cannot_drag_the_swarm_ahead_but_two_can():
    config = ProgressConfig(target_batch_size=100)
    own = record(0, 3, 10)
    honest = [record(1, 3, 10), record(2, 3, 10)]
    liar = record(9, 1_000_000, 99)
    assert estimate([*honest, liar], own=own, config=config, now=1000).epoch == 3
    backed = [record(1, 5, 10), record(2, 5, 10), liar]
    assert estimate(backed, own=own, config=config, now=1000).epoch == 5
    # in a swarm of two, the only other peer's word is all there is
    assert estimate([record(1, 4, 10)], own=own, config=config, now=1000).epoch == 4


def test_arrivals_announced_ahead_of_a_download_move_no_peers_epoch():
    config = ProgressConfig(target_batch_size=100)
    own = record(0, 3, 10)
    partners = frozenset({f"{1:064x}", f"{2:064x}"})
    ahead = [record(1, 4, 0), record(2, 4, 0), record(3, 4, 0)]
    arriving = [dataclasses.replace(r, arriving=True) for r in ahead]
    for kwargs in ({}, {"partners": partners}):
        assert estimate(ahead, own=own, config=config, now=1000, **kwargs).epoch == 4
        # the same records, announced as arrivals: no partner and no majority is there yet
        swarm = estimate(arriving, own=own, config=config, now=1000, **kwargs)
        assert swarm.epoch == 3
        assert swarm.num_at(4) == 3  # still seen there: the round of epoch 4 expects them


async def test_an_arrival_travels_in_the_record_and_is_stored_again_when_it_ends():
    config = ProgressConfig(target_batch_size=1000)  # stored again only when it tells more
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, 2)
        reader = ProgressTracker(dht=nodes[0], prefix="run", config=config)
        writer = ProgressTracker(dht=nodes[1], prefix="run", config=config)
        writer.report_local_progress(5, 0, arriving=True)
        await writer.refresh()
        seen = (await reader.refresh()).peers
        assert [(p.epoch, p.arriving) for p in seen[1:]] == [(5, True)]
        writer.report_local_progress(5, 0)  # it arrived: same epoch, no longer a promise
        await writer.refresh()
        seen = (await reader.refresh()).peers
        assert [(p.epoch, p.arriving) for p in seen[1:]] == [(5, False)]


def test_malformed_and_implausible_records():
    key = owner_subkey("ab" * 32)
    good = {"epoch": 1, "samples": 5, "samples_per_s": 1e12, "time": 1.0}
    assert parse_record(key, good, 1000.0).samples_per_s == 1000.0
    assert not parse_record(key, good, 1000.0).arriving  # absent: an ordinary record
    assert parse_record(key, {**good, "arriving": True}, 1000.0).arriving
    for bad in (
        {"epoch": "x"},
        {**good, "samples": -1},
        {**good, "samples_per_s": math.nan},
        {**good, "address": 5},
        {**good, "arriving": "yes"},
        "not a dict",
    ):
        assert parse_record(key, bad, 1000.0) is None
    assert parse_record("not-an-owner-subkey", good, 1000.0) is None


async def test_a_vanished_peer_drops_out_after_its_record_expires():
    # a record lives 3 s: with 0.5 s, a loaded CI host took longer from the leaving peer's
    # store to the other's read, and the record had expired before it was ever seen
    config = ProgressConfig(target_batch_size=1000, publish_interval_s=0.1, record_ttl_s=3.0)
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, 2)
        staying = ProgressTracker(dht=nodes[0], prefix="run", config=config)
        leaving = ProgressTracker(dht=nodes[1], prefix="run", config=config)
        leaving.report_local_progress(0, 40)
        await leaving.refresh()
        assert (await staying.refresh()).num_peers == 2
        deadline = get_dht_time() + 15
        while (await staying.refresh()).num_peers == 2:
            assert get_dht_time() < deadline
        assert staying.global_progress.samples_accumulated == 0


async def test_background_publishing_and_rate_estimate():
    # stored every interval (the gap of test_progress_publish.py off): the last report is read
    config = ProgressConfig(
        target_batch_size=10_000, publish_interval_s=0.1, record_ttl_s=5, max_publish_gap_s=0.1
    )
    async with AsyncExitStack() as stack:
        nodes = await start_nodes(stack, 2)
        async with ProgressTracker(dht=nodes[0], prefix="run", config=config) as worker:
            reader = ProgressTracker(dht=nodes[1], prefix="run", config=config)
            worker.report_local_progress(0, 0)

            for step in range(1, 6):
                await asyncio.sleep(0.1)
                worker.report_local_progress(0, step * 100)
            await asyncio.sleep(0.3)
            view = await reader.refresh()
        assert view.num_peers == 2
        worker_view = next(p for p in view.peers if p.peer_id == nodes[0].peer_id)
        assert worker_view.samples == 500
        assert 0 < worker_view.samples_per_s <= 2000  # about 1000/s, smoothed


def reporter(monkeypatch):
    """A tracker on a fake monotonic clock (the rate's arithmetic, not wall time, is under
    test); returns ``report(advance_s, epoch, samples) -> its own rate afterwards``."""
    now_s = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now_s[0])
    config = ProgressConfig(target_batch_size=10_000, publish_interval_s=2.0)
    node = SimpleNamespace(peer_id="ab" * 32, address="http://127.0.0.1:1")
    tracker = ProgressTracker(dht=node, prefix="run", config=config)

    def report(advance_s: float, epoch: int, samples: int) -> float:
        now_s[0] += advance_s
        tracker.report_local_progress(epoch, samples)
        return tracker.current().peers[0].samples_per_s

    return report


def test_the_rate_is_right_from_the_second_report(monkeypatch):
    report = reporter(monkeypatch)
    assert report(0.0, 0, 0) == 0.0
    assert report(0.1, 0, 100) == pytest.approx(1000)  # no ramp from 0
    assert report(0.3, 0, 700) == pytest.approx(700 / 0.4)  # the average of the time seen
    # past one publishing interval: a moving average with weight elapsed / interval
    assert report(1.6, 0, 2300) == pytest.approx(1750 + 0.8 * (1000 - 1750))
    assert report(1.0, 1, 0) == pytest.approx(1150)  # a report across an epoch change: no rate
    # no new samples (waiting, not training): the anchor moves, the rate stays
    assert report(5.0, 1, 0) == pytest.approx(1150)
    assert report(0.5, 1, 500) == pytest.approx(1150 + 0.25 * (1000 - 1150))


def test_a_stop_of_the_process_is_not_slow_training(monkeypatch):
    # SIGSTOP or Ctrl-Z, then SIGCONT (peer join's handler calls note_continued): the report
    # after it spans seconds for a few steps' samples; a rate that took it in would make the
    # others undercount this peer and overshoot the target (the train benchmark pauses swarms
    # this way). A slow stretch without a stop is learned as ever.
    report = reporter(monkeypatch)
    report(0.0, 0, 0)
    assert report(0.1, 0, 100) == pytest.approx(1000)
    progress_module.note_continued()  # stopped for about 2 s
    assert report(2.0, 0, 200) == pytest.approx(1000)
    assert report(0.1, 0, 300) == pytest.approx(1000)  # the anchor moved past the stop
    assert report(2.0, 0, 400) == pytest.approx(50)  # no stop: really 20x slower


@pytest.mark.parametrize("replicas", [0, -1, True, 2.0, "8"])
def test_a_bad_read_replicas_is_refused_naming_the_field(replicas):
    with pytest.raises(ConfigError, match="read_replicas"):
        ProgressConfig(target_batch_size=100, read_replicas=replicas)
    assert ProgressConfig(target_batch_size=100, read_replicas=3).read_replicas == 3


@pytest.mark.parametrize(("read", "store"), [(8, 4), (None, 12), (8, 0)])
def test_stores_to_fewer_replicas_than_readers_merge_are_refused(read, store):
    # a reader merges the closest ``read``: a writer that reaches fewer leaves it records short
    with pytest.raises(ConfigError, match="store_replicas"):
        ProgressConfig(target_batch_size=100, read_replicas=read, store_replicas=store)
    config = ProgressConfig(target_batch_size=100, read_replicas=8, store_replicas=8)
    assert config.store_replicas == 8


def test_partners_stand_for_the_whole_round_their_top_round_reached():
    """Only partners count in a swarm read whole, and after rows and a top round a peer's
    partners are its row: each row reached the target on its own (32 peers in three rows
    trained 3.5-4.3x the target per epoch). The row's samples now stand for the peers the round
    reached, bounded by the peers whose records were read."""
    config = ProgressConfig(target_batch_size=10_000)
    own = record(0, 5, 100, now=1000.0)
    partners = [record(i, 5, 100, now=1000.0) for i in (1, 2, 3)]
    elsewhere = [record(i, 4, 900, now=1000.0) for i in (4, 5, 6, 7)]  # not partners: not counted
    trusted = frozenset(r.peer_id for r in partners)

    def accumulated(round_reach):
        view = estimate(
            [*partners, *elsewhere],
            own=own,
            config=config,
            now=1000.0,
            partners=trusted,
            round_reach=round_reach,
        )
        return view.samples_accumulated

    assert accumulated(None) == 400  # the row's own samples
    assert accumulated((5, 8)) == 800  # 4 counted stand for the 8 the round reached
    assert accumulated((5, 1_000)) == 800  # a count beyond the 8 records read moves nothing
    assert accumulated((4, 8)) == 400  # a round that entered another epoch
    assert accumulated((5, 3)) == 400  # never below the samples counted
