"""The swarm simulation: deterministic from its seed, and a peer's DHT traffic that does not grow
with the swarm (a behaviour of the bucketed progress design, not a timing)."""

from __future__ import annotations

import pytest

from peer.bench.swarm_sim import simulate

pytestmark = pytest.mark.timeout(200)  # 31 s alone; over 110 s beside a 256-peer bench
# From 200 to 800 peers a peer reads as many buckets of about as many records (the fill swings
# between 11 and 23 with the layout's rounding); lookups add a few hops with log2(N). A design
# that reads every record would grow 4x.
MAX_GROWTH = 1.6


def without_wall_time(report: dict) -> dict:
    return {name: value for name, value in report.items() if name != "wall_s"}


def test_the_same_seed_gives_the_same_figures():
    first = simulate(120, seconds=10.0, seed=3)
    assert without_wall_time(first) == without_wall_time(simulate(120, seconds=10.0, seed=3))
    assert without_wall_time(first) != without_wall_time(simulate(120, seconds=10.0, seed=4))


def test_traffic_per_peer_does_not_grow_with_the_swarm():
    small = simulate(200, seconds=20.0, seed=1)
    large = simulate(800, seconds=20.0, seed=1)
    assert small["peers"] == 200 and large["peers"] == 800
    growth = large["dht_bytes_per_peer_per_s"] / small["dht_bytes_per_peer_per_s"]
    assert growth <= MAX_GROWTH, (small, large)
    for report in (small, large):
        assert report["keys_read_per_interval_max"] <= 8
        assert report["max_key_bytes"] <= report["key_cap_bytes"] // 16
        assert report["max_node_dht_bytes_per_s"] <= 10 * report["median_node_dht_bytes_per_s"]
        assert report["progress_error_p50"] <= 0.15
        assert report["in_group_fraction"] >= 0.8
        assert report["rounds"] > 0


def test_churn_keeps_the_swarm_and_its_estimate():
    report = simulate(300, seconds=20.0, churn_per_s=0.01, seed=2)  # 3 newcomers a second
    assert report["peers"] == 300
    assert report["progress_error_p95"] is not None and report["progress_error_p50"] <= 0.2
    assert report["in_group_fraction"] >= 0.7


def test_on_a_busy_host_the_swarm_is_still_counted():
    # refresh cycles of 2 to 42 s (a host whose DHT requests queue for up to 40 s), against
    # records that lived a fixed 20 s: 0.67 of the swarm counted at the median read, 0.27 at
    # the 5th percentile
    report = simulate(256, seconds=120.0, busy_s=40.0, seed=0)
    assert report["size_ratio_p50"] >= 0.85, report
    assert report["size_ratio_p05"] >= 0.5, report


def test_on_a_busy_host_a_round_lays_its_keys_out_as_its_last_round_reached():
    # estimates that straddle an edge of the key layout (64 peers, g 16: 1 bucket below 45,
    # 2 above) split the searches of an epoch over two layouts; the count the last round
    # reached is one number for all its members
    own = simulate(64, seconds=120.0, busy_s=40.0, seed=0, layout_memory=False)
    shared = simulate(64, seconds=120.0, busy_s=40.0, seed=0)
    assert own["layout_split_fraction"] >= 0.15, own  # 0.20 with seed 0
    assert shared["layout_split_fraction"] <= 0.6 * own["layout_split_fraction"], shared
    assert shared["in_group_fraction"] >= 0.9, shared
