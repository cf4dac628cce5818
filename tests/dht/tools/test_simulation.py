"""Kademlia at scale: a thousand in-memory nodes in one process, with churn and lossy links."""

from __future__ import annotations

import math

import pytest

from dht.config import DHTConfig
from dht.tools.memory import LatencyModel
from dht.tools.simulation import run_simulation, simulate


@pytest.mark.timeout(240)
async def test_thousand_nodes_with_a_fifth_killed_still_find_every_value():
    report = await run_simulation(
        num_nodes=1000,
        churn_fraction=0.2,
        num_keys=300,
        latency=LatencyModel(base_s=0.0005, jitter_s=0.0005),
        seed=1,
        join_fraction=0.05,
        # killed nodes refuse at once and nothing is dropped here, so the RPC timeout only
        # judges late answers: 1000 nodes share one event loop, and on a loaded machine an
        # answer can come later than a second without being lost
        config=DHTConfig(rpc_timeout_s=5.0),
    )
    assert report.num_killed == 200 and report.num_joined == 50
    assert report.store_success_rate == 1.0
    assert report.get_success_rate > 0.99
    assert report.hops_median < 4
    # log2(1000) is about 10: routing must do far better than a walk through the id space.
    assert report.hops_p90 <= math.log2(report.num_nodes) / 2
    assert report.num_local_gets < report.num_keys


@pytest.mark.timeout(120)
def test_lossy_network_loses_no_values():
    report = simulate(
        num_nodes=150,
        churn_fraction=0.1,
        num_keys=60,
        latency=LatencyModel(base_s=0.0005, drop_probability=0.02),
        seed=2,
        # generous: on a loaded 2-core machine 150 nodes share one loop, and a late answer must
        # not pass for a dropped one; drops still cost each lookup a wait of this long
        config=DHTConfig(rpc_timeout_s=1.0, bucket_size=10),
    )
    assert report.store_success_rate == 1.0
    assert report.get_success_rate == 1.0
    assert report.hops_median < 4


def test_simulation_arguments_are_checked():
    with pytest.raises(ValueError, match="churn_fraction"):
        simulate(num_nodes=10, churn_fraction=1.0, num_keys=1)
