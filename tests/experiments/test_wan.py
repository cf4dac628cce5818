"""The WAN preset's parts end to end: a sweep in namespaces with latency and loss through the
user-space emulator (this kernel has no sch_netem) and one peer behind NAT, relayed by the
bootstrap node; the swarm averages, the peers measure the emulated RTT and the report shows
it. Needs root, iproute2, nftables and /dev/net/tun; CI runs as root."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest

from experiments.launch.netns import list_namespaces
from experiments.spec import SpecError, load_spec, parse_spec
from tests.experiments.helpers import ROOT, peer_cli, read_lines, tiny_spec

pytestmark = pytest.mark.timeout(240)
NEEDS_NETNS = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None or not os.path.exists("/dev/net/tun"),
    reason="needs root, nftables and /dev/net/tun",
)

NETWORK = """
[network]
emulator = "linkemu"
latency_ms = 10
loss_percent = 0.1

[[network.groups]]
peers = [1]
nat = true
latency_ms = 10
bandwidth_mbit = 20
loss_percent = 0.1
"""


def test_the_wan_preset_is_valid_and_puts_two_of_four_peers_behind_nat():
    spec = load_spec(ROOT / "experiments" / "presets" / "wan.toml")
    assert spec.launcher == "netns" and spec.train.peers == 4
    assert [spec.network.behind_nat(i) for i in range(4)] == [False, False, True, True]
    links = [spec.network.link_for(i) for i in range(4)]
    # any two peers: two links of 10 ms each way, so 40 ms RTT
    assert all(link.latency_ms == 10 and link.loss_percent == 0.1 for link in links)
    assert {link.bandwidth_mbit for link in links} == {20, 100}


def _data(network: str) -> dict:
    import tomllib

    return tomllib.loads(tiny_spec("w", launcher="netns") + network)


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ('[network]\nemulator = "ns3"\n', "network.emulator"),
        ("[[network.groups]]\npeers = [0, 1]\nnat = true\n", "all 2 peers are behind NAT"),
        ("[[network.groups]]\npeers = [0]\nnat = 1.5\n", r"network\.groups\.0\.nat"),
    ],
)
def test_bad_network_settings_name_the_key(network: str, message: str):
    with pytest.raises(SpecError, match=message):
        parse_spec(_data(network))


def test_nat_needs_the_netns_launcher():
    data = _data("[[network.groups]]\npeers = [1]\nnat = true\n") | {"launcher": "local"}
    with pytest.raises(SpecError, match="launcher = 'netns'"):
        parse_spec(data)


@NEEDS_NETNS
def test_a_swarm_across_an_emulated_wan_with_a_peer_behind_nat(tmp_path: Path):
    before = set(list_namespaces())
    spec = tmp_path / "spec.toml"
    spec.write_text(tiny_spec("wan", launcher="netns", stop="max_time_s = 8") + NETWORK)
    out = tmp_path / "out"
    result = peer_cli("experiment", "run", str(spec), "--out", str(out), timeout_s=200)
    assert result.returncode == 0, result.stderr[-3000:]
    run = out / "swarm_seed-0"
    assert json.loads((run / "status.json").read_text())["status"] == "done"
    # the reachable peer serves; the one behind NAT found nobody can dial it and is relayed
    assert "reachable at http://" in (run / "peer-0.log").read_text()
    assert "not reachable from the swarm: relayed via" in (run / "peer-1.log").read_text()
    lines = {i: read_lines(run / f"peer-{i}.jsonl") for i in range(2)}
    # both averaged: the peer behind NAT took part in all-reduce rounds, dialling out
    for index in range(2):
        assert sum(line["phases"]["allreduce"] for line in lines[index]) > 0
        assert max(line["epoch"] for line in lines[index]) >= 1
    # what they measured: 20 ms to the bootstrap node (one link), 40 ms to each other (two)
    rtts = [
        line["net"]["rtt_ms"] for ls in lines.values() for line in ls if "rtt_ms" in line["net"]
    ]
    # (a busy peer answers late at times: the median, and never below the wire's RTT)
    assert rtts and min(rtts) >= 20 * 0.95 and statistics.median(rtts) <= 40 * 1.15
    stats = [json.loads(p.read_text()) for p in run.glob("linkemu-*.stats.json")]
    assert len(stats) == 2 and all(s["a_to_b"]["num_frames"] > 0 for s in stats)
    report = peer_cli("experiment", "report", str(out), timeout_s=120)
    assert report.returncode == 0, report.stderr
    assert "| rtt_ms |" in (out / "report.md").read_text()
    left = set(list_namespaces()) - before  # other sweeps may run beside this one
    assert not [name for name in left if name.endswith("-r1")]
