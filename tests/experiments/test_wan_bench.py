"""``peer bench allreduce --latency-ms/--bandwidth-mbit``: the peers in namespaces behind emulated
links still average exactly, and no round beats what the emulated link can carry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.experiments.helpers import peer_cli

pytestmark = pytest.mark.timeout(180)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/net/tun"), reason="needs root and /dev/net/tun"
)
def test_allreduce_over_an_emulated_link_is_exact_and_bounded_by_the_rate():
    result = peer_cli(
        "bench", "allreduce", "--peers", "2", "--size", "500000", "--rounds", "2",
        "--latency-ms", "20", "--bandwidth-mbit", "40", "--json", timeout_s=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 2 and out["max_abs_err"] < 1e-6
    assert (out["latency_ms"], out["bandwidth_mbit"]) == (20.0, 40.0)
    # each peer sends its half out and gets it back reduced through its 40 Mbit/s link
    assert out["allreduce_s_p50"] >= out["bytes_sent_per_peer"] * 8 / 40e6 / 2
    assert out["gbit_per_s"] * 1e3 <= 40


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/net/tun"), reason="needs root and /dev/net/tun"
)
def test_several_streams_over_a_lossy_cubic_link_are_exact_and_leave_the_host_as_it_was():
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    before = allowed.read_text()
    result = peer_cli(
        "bench", "allreduce", "--peers", "2", "--size", "300000", "--rounds", "2",
        "--latency-ms", "10", "--bandwidth-mbit", "40", "--loss-pct", "0.1",
        "--tcp-congestion", "cubic", "--streams", "3", "--json", timeout_s=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 2 and out["max_abs_err"] < 1e-6
    assert (out["streams_per_pair"], out["loss_pct"], out["tcp_congestion"]) == (3, 0.1, "cubic")
    assert allowed.read_text() == before  # cubic was allowed in namespaces for the run only


def test_emulation_flags_are_refused_for_the_hivemind_backend_in_one_line():
    result = peer_cli(
        "bench", "allreduce", "--backend", "hivemind", "--latency-ms", "5", timeout_s=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "peer: error: --latency-ms/--bandwidth-mbit/--loss-pct/--tcp-congestion: only with "
        "--backend native"
    ]
