"""A light peer of ``peer bench swarm`` stops looking for a group once the swarm has left its
epoch, as ``peer join``'s optimizer does (issue 24). It used to look until its matchmaking time
ran out: a peer left out of one round then entered the next epoch seconds late, the others
planned that round from a read that showed it an epoch behind, and it was left out again (a
six-peer bench run with 3-s epochs and 5-s matchmaking kept one peer out of all four rounds)."""

from __future__ import annotations

import asyncio

import pytest

from averaging.config import AveragerConfig
from peer.bench.swarm_peer import PeerSpec, SwarmPeer
from peer.swarm.moved_on import MOVED_ON
from peer.swarm.progress import ProgressConfig
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

# far longer than the test's guard below: only the swarm moving on can end the search in time
MATCHMAKING_TIME_S = 40.0


def spec() -> PeerSpec:
    return PeerSpec(
        size=16,
        seed=0,
        last_epoch=None,
        samples_per_s=100.0,
        step_s=0.2,
        progress=ProgressConfig(target_batch_size=10**9, publish_interval_s=0.2),
        averager=AveragerConfig(
            matchmaking_time_s=MATCHMAKING_TIME_S, request_timeout_s=2.0, group_wait_s=2.0
        ),
        step_timeout_s=MATCHMAKING_TIME_S + 10.0,
        rpc_timeout_s=2.0,
        bootstrap_timeout_s=5.0,
    )


async def test_a_light_peer_left_at_an_old_epoch_stops_looking_once_the_swarm_moved_on():
    peers = [SwarmPeer(0, spec(), [])]
    await peers[0].start()
    try:
        for rank in (1, 2):
            peers.append(SwarmPeer(rank, spec(), [peers[0].transport.address]))
            await peers[-1].start()
        late, *ahead = peers
        late.samples = 50.0
        late.tracker.report_local_progress(0, 50)
        for peer in ahead:
            peer._enter(2)  # the others have gone two epochs on
        await wait_until(lambda: late.tracker.current().epoch == 2, timeout_s=20.0)

        # it counts three peers at its epoch (a stale read), so it looks for a group of three;
        # only the swarm having moved on can end that search within half its matchmaking time
        fact = await asyncio.wait_for(late._average(3), timeout=MATCHMAKING_TIME_S / 2)

        assert fact["status"] == "alone" and fact["reason"] == f"{MOVED_ON} 2", fact["reason"]
        assert fact["epoch"] == 0 and late.epoch == 1  # it steps on, then catches up
    finally:
        for peer in reversed(peers):
            await peer.close()
