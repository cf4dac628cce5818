"""Deadlines that adapt, at 150 ms RTT on a thin link (peers in namespaces behind the user-space
link emulator): the fixed defaults time out every round, the adaptive ones average exactly.

Why this configuration: RTT alone does not break the fixed 5 s waits (matchmaking takes about
0.9 s at 150 ms RTT, and 3 peers at 20 Mbit/s with small models averaged fine). What breaks
them is a chunk that takes longer than the fixed 5 s sender wait. A part of 1M values goes as
4 chunks of 1 MiB, 1.7 s each at 5 Mbit/s on an idle link; but each peer's uplink carries its
own part to the other reducer and the averaged part back at once (8 MiB, 13 s), and two TCP
flows at 150 ms RTT share it unevenly, so single chunks took 2 to 10 s (measured): a reducer
drops the sender mid-part, every round with the fixed waits is partial. With adaptive deadlines
the first round (cold start, at the same 5 s) is partial too; the wait that ran out doubles
(10 s, which measured chunk waits still exceeded now and then), then the rounds measure it and
the waits settle at 4 times the 90th percentile of the chunk waits (15-35 s).
"""

from __future__ import annotations

import os

import pytest

from averaging.bench.allreduce import run_allreduce_bench
from averaging.config import AveragerConfig
from experiments.bench_network import emulated_places

pytestmark = pytest.mark.timeout(400)

NUM_PEERS, SIZE = 2, 2_000_000  # one 4 MiB chunk per part
LATENCY_MS, MBIT = 75.0, 5.0  # one way between two peers: 150 ms RTT


def rounds_with(places, config: AveragerConfig, num_rounds: int) -> list[dict]:
    out = run_allreduce_bench(
        NUM_PEERS,
        SIZE,
        num_rounds=num_rounds,
        num_warmup=0,
        config=config,
        places=places,
        include_rounds=True,
        timeout_s=300,
    )
    return out["round_details"]


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/net/tun"), reason="needs root and /dev/net/tun"
)
def test_at_150_ms_on_a_thin_link_fixed_waits_fail_and_adaptive_ones_average_exactly():
    fixed = AveragerConfig(target_group_size=2, min_group_size=2, adaptive_deadlines=False)
    adaptive = AveragerConfig(target_group_size=2, min_group_size=2)
    with emulated_places(NUM_PEERS, latency_ms=LATENCY_MS, bandwidth_mbit=MBIT) as places:
        fixed_rounds = rounds_with(places, fixed, 2)
        adaptive_rounds = rounds_with(places, adaptive, 4)
    for details in fixed_rounds:  # every round loses a chunk to the fixed 5 s wait
        assert "partial" in details["statuses"] or "failed" in details["statuses"], details
        assert details["deadlines_s"]["sender_s"] == fixed.sender_timeout_s
    assert adaptive_rounds[0]["deadlines_s"]["sender_s"] == adaptive.sender_timeout_s  # cold
    for details in adaptive_rounds[2:]:  # after at most two rounds of backing off
        assert details["statuses"] == ["ok"] * NUM_PEERS, details
        assert details["max_abs_err"] < 1e-6, details  # the exact weighted mean
        # grown past the fixed bound: backed off after the cold start, then measured
        assert details["deadlines_s"]["sender_s"] > fixed.sender_timeout_s, details
        assert details["deadlines_s"]["reducer_s"] > fixed.reducer_timeout_s, details
