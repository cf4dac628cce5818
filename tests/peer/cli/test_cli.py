"""The ``peer`` command as a user runs it: real processes."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
PEER = [sys.executable, "-m", "peer"]
BENCH_DHT_FIELDS = {
    "nodes",
    "store_ok",
    "get_ok",
    "get_p50_ms",
    "get_p99_ms",
    "store_p50_ms",
    "bootstrap_s",
    "rss_mb",
}


def run(
    *args: str, timeout_s: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``peer *args``; ``env``: variables set on top of this process's environment."""
    return subprocess.run(
        [*PEER, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.parametrize(
    "args", [[], ["dht"], ["bench"], ["bench", "dht"], ["bench", "allreduce"], ["demo"], ["join"]]
)
def test_help_works(args):
    result = run(*args, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: peer" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--no-such-flag"],
        ["dht", "--port", "notaport"],
        ["bench", "dht", "--nodes", "0"],
        ["frobnicate"],
        ["bench", "allreduce", "--peers", "1"],
        ["bench", "allreduce", "--compare", "native"],
        ["bench", "train", "--window", "5"],
        ["dht", "--initial-peers", "localhost"],
        ["dht", "--port", "70000"],
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args):
    result = run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("peer") and "error" in lines[0]
    assert "Traceback" not in result.stderr


def start_dht(*args: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [*PEER, "dht", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = process.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), process.stderr.read() if not url else url
    return process, url


def test_dht_nodes_join_and_stop_cleanly_on_ctrl_c(tmp_path):
    bootstrap, url = start_dht("--identity", str(tmp_path / "boot.key"))
    second, second_url = start_dht("--initial-peers", url)
    try:
        assert second_url != url
        assert (tmp_path / "boot.key").stat().st_mode & 0o777 == 0o600
    finally:
        for process in (second, bootstrap):
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=20) == 0
            assert "Traceback" not in process.stderr.read()


def test_bench_dht_prints_the_contract_json():
    result = run("bench", "dht", "--nodes", "8", "--keys", "20", "--json", timeout_s=100)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert BENCH_DHT_FIELDS <= set(report)
    assert report["nodes"] == 8
    assert report["store_ok"] == report["get_ok"] == 1.0
    assert 0 < report["get_p50_ms"] <= report["get_p99_ms"]


DEMO_FIELDS = {"peers", "seconds", "rounds", "final_loss", "samples_per_s"}


def test_demo_trains_a_swarm_and_prints_the_contract_json():
    result = run(
        "demo",
        "--peers",
        "2",
        "--seconds",
        "6",
        "--target-batch-size",
        "256",
        "--json",
        timeout_s=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == DEMO_FIELDS
    assert report["peers"] == 2 and report["rounds"] >= 1
    assert report["samples_per_s"] > 0 and report["final_loss"] < 2.31  # below ln(10) = 2.30+


def test_join_rejects_bad_input_with_one_line():
    for args, needle in [
        (["join", "--task", "nonsense"], "unknown task"),
        (["join", "--target-batch-size", "-5"], "--target-batch-size"),
        (["join", "--task", "charlm", "--task-option", "path=/no/such/file.txt"], "file"),
    ]:
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], result.stderr


def test_join_refuses_a_bad_option_before_it_imports_torch():
    """A mistyped value answers in a fraction of a second: importing torch took 2 s of CPU."""
    code = (
        "import sys\n"
        "from peer.cli.main import main\n"
        "sys.argv = ['peer', 'join', '--target-batch-size', '-5']\n"
        "code = main()\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert "--target-batch-size" in result.stderr


ALLREDUCE_FIELDS = {
    "backend",
    "peers",
    "size",
    "compression",
    "rounds",
    "round_s_p50",
    "allreduce_s_p50",
    "matchmaking_s_p50",
    "max_abs_err",
    "bytes_sent_per_peer",
    "gbit_per_s",
    "deadlines_s",  # an addition: the averager's waits after the last round
    "streams_per_pair",  # an addition: streams per sender and reducer the groups used
}


def test_bench_allreduce_prints_the_contract_json():
    result = run(
        "bench",
        "allreduce",
        "--peers",
        "2",
        "--size",
        "100000",
        "--rounds",
        "2",
        "--json",
        timeout_s=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == ALLREDUCE_FIELDS
    assert report["rounds"] == 2 and report["max_abs_err"] < 1e-5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--streams", "9"], "--streams"),
        (["--loss-pct", "100"], "--loss-pct"),
        (["--backend", "hivemind", "--streams", "2"], "--streams: only with --backend native"),
        (["--tcp-congestion", "Not A Name"], "--tcp-congestion"),
    ],
)
def test_bench_allreduce_refuses_bad_network_flags_in_one_line(flags, message):
    result = run("bench", "allreduce", *flags, "--json", timeout_s=60)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


TRAIN_FIELDS = {
    "backend",
    "peers",
    "task",
    "seconds",
    "samples_per_s",
    "baseline_samples_per_s",
    "final_loss",
    "baseline_final_loss",
    "rounds",
}


def test_bench_train_prints_the_contract_json_from_interleaved_windows():
    result = run(
        "bench", "train", "--peers", "1", "--seconds", "3", "--window", "0.75", "--threads", "1",
        "--target-batch-size", "256", "--task-option", "hidden_dim=64", "--json",
        timeout_s=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert TRAIN_FIELDS <= set(report)
    assert report["peers"] == 1 and report["rounds"] >= 1 and report["failed_rounds"] == 0
    # 3 s per side in windows of 0.75 s: 4 pairs, the ratio their median, the rates medians too
    assert report["num_pairs"] <= 4 and report["window_s"] == 0.75
    assert len(report["windows_samples_per_s"]) == len(report["baseline_windows_samples_per_s"])
    ratios = [
        swarm / plain
        for swarm, plain in zip(
            report["windows_samples_per_s"], report["baseline_windows_samples_per_s"], strict=True
        )
        if swarm is not None and plain is not None
    ]
    assert report["ratios"] == pytest.approx(ratios, rel=1e-3, abs=1e-3)
    assert report["ratio_p50"] == pytest.approx(statistics.median(ratios), rel=1e-3)
    assert report["ratio_min"] <= report["ratio_p50"] <= report["ratio_max"]
    assert report["ratio"] == pytest.approx(report["ratio_p50"], abs=1e-3)
    assert report["samples_per_s"] == pytest.approx(
        statistics.median(r for r in report["windows_samples_per_s"] if r is not None), abs=0.1
    )
    # both sides trained the same task on the same data, as far as the windows took them
    assert report["baseline_samples"] > 0 and report["baseline_eval_loss"] is not None
    assert report["runs_ratio"] == [report["ratio"]]


def test_a_paused_two_peer_swarm_fails_no_round_and_holds_its_target():
    # the swarm is stopped for up to two baseline windows at a time: no wait of a round may run
    # out during a pause, and the pause must not read as slow training (which made the peers
    # undercount each other and gather 2-4x the target per epoch). Unpaced (the peers read
    # VP_MIN_ROUND_INTERVAL as --min-round-interval): these epochs are shorter than the 0.05-s
    # pace, which would gather more than the target on purpose
    target = 1024
    result = run(
        "bench", "train", "--peers", "2", "--seconds", "6", "--window", "1", "--threads", "2",
        "--target-batch-size", str(target), "--task-option", "hidden_dim=64", "--json",
        timeout_s=150, env={"VP_MIN_ROUND_INTERVAL": "0"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed_rounds"] == 0 and report["num_pairs"] >= 5
    # against two plain loops of the peers' shape (1 thread each here), both of which trained
    assert report["baseline"] == "matched" and report["baseline_samples"] > 0
    assert report["rounds"] >= 10
    assert report["samples"] / report["rounds"] < 1.5 * target
