"""``peer profile summarize`` and the metrics stream's schema: a real peer's lines validate,
broken lines are named, and the per-peer and swarm breakdowns are the numbers in the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peer.cli.main import main
from peer.profiling.metrics_reader import validate_line
from peer.profiling.phases import PHASES
from peer.run.runner import PeerRun
from tests.peer.run.test_join import config

pytestmark = pytest.mark.timeout(60)
PEER_A, PEER_B = "a" * 64, "b" * 64


def line(peer: str, *, t: float, samples: int, sent: int = 0, **phases: float) -> dict:
    return {
        "t": t,
        "peer": peer,
        "run": "r",
        "epoch": 1,
        "step": 10,
        "loss": 0.5,
        "samples": samples,
        "samples_per_s": samples / sum(phases.values()),
        "phases": {phase: phases.get(phase, 0.0) for phase in PHASES},
        "net": {"sent": sent, "recv": sent // 2},
        "cpu_percent": 100.0,
        "rss_bytes": 2**20,
    }


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.fixture
def files(tmp_path):
    # peer A waits for data 6 s of 10; peer B all-reduces 4 s of 8 (sending 10 MB meanwhile)
    a = write(
        tmp_path / "a.jsonl",
        [
            line(PEER_A, t=1, samples=100, data=3.0, forward=1.0, backward=1.0),
            "{not json",
            line(PEER_A, t=2, samples=100, data=3.0, forward=0.5, backward=0.5, other=1.0),
        ],
    )
    b = write(
        tmp_path / "b.jsonl",
        [
            line(PEER_B, t=1, samples=300, sent=4_000_000, forward=2.0, allreduce=2.0),
            line(PEER_B, t=2, samples=300, sent=6_000_000, forward=1.0, allreduce=2.0, idle=1.0),
        ],
    )
    return a, b


def test_json_breakdown_per_peer_and_for_the_swarm(files, capsys):
    assert main(["profile", "summarize", *map(str, files), "--json"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 invalid line(s)" in captured.err and "line 2: not JSON" in captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    peers = {peer["peer"]: peer for peer in result["peers"]}
    a, b = peers[PEER_A], peers[PEER_B]
    assert a["wall_s"] == pytest.approx(10.0) and b["wall_s"] == pytest.approx(8.0)
    assert a["fractions"]["data"] == pytest.approx(0.6)
    assert a["fractions"]["other"] == pytest.approx(0.1)
    assert b["fractions"]["allreduce"] == pytest.approx(0.5)
    assert a["samples_per_s"] == pytest.approx(20.0) and b["samples_per_s"] == pytest.approx(75.0)
    assert b["sent_bytes_per_s"] == pytest.approx(10e6 / 8)
    assert a["num_lines"] == 2 and b["num_lines"] == 2
    assert a["bottleneck"] == "data" and a["verdict"].startswith("data-loading bound: 60%")
    # 10 MB sent in 4 s of all-reduce: 20 Mbit/s
    assert b["verdict"].startswith("communication bound: all-reduce 50% at 20 Mbit/s")
    swarm = result["swarm"]
    assert swarm["num_peers"] == 2
    # fractions over all 18 peer-seconds; rates summed over the peers' mean 9 s
    assert swarm["fractions"]["data"] == pytest.approx(6 / 18)
    assert swarm["fractions"]["allreduce"] == pytest.approx(4 / 18)
    assert swarm["fractions"]["idle"] == pytest.approx(1 / 18)
    assert swarm["samples_per_s"] == pytest.approx(800 / 9)
    assert swarm["bottleneck"] == "data"


def test_tables_name_every_peer_and_its_verdict(files, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["profile", "summarize", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert PEER_A[:8] in out and PEER_B[:8] in out and "2 peers" in out
    assert "data-loading bound: 60% of wall time waiting for batches" in out
    assert "communication bound: all-reduce 50% at 20 Mbit/s" in out
    assert "60.0" in out and "50.0" in out  # the percentages in the tables


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["profile", "summarize", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and "missing.jsonl" in err
    empty = write(tmp_path / "bad.jsonl", ['{"t": 1}'])
    assert main(["profile", "summarize", str(empty)]) == 2
    assert "no valid metrics lines" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "summarize"])
    assert exit_info.value.code == 2


def test_the_schema_names_what_is_wrong():
    good = line(PEER_A, t=1, samples=10, forward=1.0)
    assert validate_line(json.dumps(good)).phases["forward"] == 1.0
    with_gpu = {**good, "gpu": {"memory_allocated_bytes": 5}, "verdict": "extra fields are fine"}
    assert validate_line(json.dumps(with_gpu)).gpu == {"memory_allocated_bytes": 5}
    for broken, where in [
        ({k: v for k, v in good.items() if k != "rss_bytes"}, "rss_bytes"),
        ({**good, "phases": {"forward": 1.0}}, "phases"),
        ({**good, "samples": -1}, "samples"),
        ({**good, "net": {"sent": 1}}, "net.recv"),
        ({**good, "loss": "low"}, "loss"),
    ]:
        with pytest.raises(ValueError, match=where):
            validate_line(json.dumps(broken))


def test_a_real_peers_stream_validates_and_summarizes(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    summary = PeerRun(config(seed=5, max_time=1.5, metrics_file=path, metrics_interval=0.3)).run()
    capsys.readouterr()
    lines = [validate_line(text) for text in path.read_text().splitlines()]
    assert len(lines) >= 3 and {line.peer for line in lines} == {summary.peer_id}
    assert main(["profile", "summarize", str(path), "--json"]) == 0
    (peer,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peers"]
    assert peer["samples"] == summary.num_samples
    assert peer["wall_s"] == pytest.approx(sum(sum(x.phases.values()) for x in lines))
    assert sum(peer["fractions"].values()) == pytest.approx(1.0)
