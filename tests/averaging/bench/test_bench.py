"""``run_allreduce_bench``: real peer processes; the contract fields of DESIGN.md."""

from __future__ import annotations

import pytest

from averaging.bench.allreduce import run_allreduce_bench

pytestmark = pytest.mark.timeout(120)
CONTRACT = {
    "backend", "peers", "size", "compression", "rounds", "round_s_p50", "allreduce_s_p50",
    "matchmaking_s_p50", "max_abs_err", "bytes_sent_per_peer", "gbit_per_s",
}  # fmt: skip


def test_bench_reports_the_contract_fields():
    result = run_allreduce_bench(2, 10_001, "none", 2, num_warmup=0)
    # extras: the last round's waits, and the streams per pair the groups used
    assert set(result) == CONTRACT | {"deadlines_s", "streams_per_pair"}
    assert result["streams_per_pair"] == 1  # loopback: one
    assert set(result["deadlines_s"]) == {
        "matchmaking_s", "sender_s", "connect_s", "reducer_s", "group_wait_s", "request_s",
        "allreduce_s",
    }  # fmt: skip
    assert result["backend"] == "native" and result["peers"] == 2 and result["rounds"] == 2
    assert result["max_abs_err"] < 1e-6
    assert result["bytes_sent_per_peer"] >= 4 * 10_001 // 2
    assert result["round_s_p50"] >= result["allreduce_s_p50"] > 0
