"""``peer bench compare``: both backends in one run, Markdown tables whose ratios match the JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from peer.bench.compare import Cell, paired_allreduce, paired_row
from peer.bench.compare_markdown import render_markdown

pytestmark = pytest.mark.timeout(240)

ALLREDUCE_CONTRACT = {
    "backend", "peers", "size", "compression", "rounds", "round_s_p50", "allreduce_s_p50",
    "matchmaking_s_p50", "max_abs_err", "bytes_sent_per_peer", "gbit_per_s",
}  # fmt: skip
DHT_CONTRACT = {
    "nodes", "store_ok", "get_ok", "get_p50_ms", "get_p99_ms", "store_p50_ms", "bootstrap_s",
    "rss_mb",
}  # fmt: skip
TRAIN = {"task": "synthetic", "peers": 2, "final_loss": 1.0, "eval_loss": 1.0, "rounds": 3}
MACHINE = {
    "cpu_count": 2, "memory_gb": 8.0, "load_average": [1.0, 1.0, 1.0], "platform": "x",
    "python": "3.11", "torch": "2", "hivemind": "1.1.12", "time_utc": "now",
}  # fmt: skip


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    finally:
        try:  # hivemind's processes and p2pd daemons, should any outlive the run
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def test_quick_compare_runs_both_backends_and_reports_their_ratio(tmp_path):
    pytest.importorskip("hivemind", reason="the hivemind side needs the [hivemind] extra")
    out = tmp_path / "bench.md"
    done = _run(
        [sys.executable, "-m", "peer", "bench", "compare", "--quick", "--out", str(out), "--json"],
        timeout_s=200,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    [[native, hive]] = report["allreduce"]
    for cell, backend in ((native, "native"), (hive, "hivemind")):
        assert cell["error"] is None
        assert cell["backend"] == backend
        assert ALLREDUCE_CONTRACT <= set(cell["result"])
        assert cell["result"]["backend"] == backend
        assert (cell["result"]["size"], cell["result"]["peers"]) == (10_000, 2)
        assert cell["result"]["max_abs_err"] < 1e-5  # float32 against the exact float64 mean
        assert f"--backend {backend} --peers 2 --size 10000" in cell["command"]
    [[dht_native, dht_hive]] = report["dht"]
    for cell in (dht_native, dht_hive):
        assert DHT_CONTRACT <= set(cell["result"])
        assert cell["result"]["get_ok"] == 1.0
    assert report["train"] == []  # --quick leaves training out
    markdown = out.read_text()
    assert markdown in done.stdout
    ratio = hive["result"]["round_s_p50"] / native["result"]["round_s_p50"]
    assert native["ratio"]["num_pairs"] == 1  # --quick: one run per backend
    assert native["ratio"]["ratio_p50"] == pytest.approx(ratio, abs=1e-3)
    assert f"| {native['ratio']['ratio_p50']:.2f}x (1 pair) |" in markdown
    assert native["command"] in markdown and hive["command"] in markdown


def test_markdown_ratios_and_failed_cells():
    def cell(backend: str, result=None, error=None) -> dict:
        return {"backend": backend, "command": f"peer bench x --backend {backend}",
                "result": result, "error": error, "seconds": 1.0}  # fmt: skip

    train = {"task": "synthetic", "peers": 2, "final_loss": 1.0, "eval_loss": 1.0, "rounds": 3}
    report = {
        "machine": MACHINE,
        "allreduce": [],
        "train": [
            [
                cell("native", train | {"samples_per_s": 900.0, "peak_pss_mb_per_peer": 200.0}),
                cell("hivemind", train | {"samples_per_s": 150.0, "peak_pss_mb_per_peer": 700.0}),
            ],
            [cell("native", train | {"samples_per_s": 10.0}), cell("hivemind", error="Boom: x")],
        ],
        "dht": [],
    }
    markdown = render_markdown(report)
    assert "| 6.00x |" in markdown  # samples/s: native / hivemind
    assert "| 3.50x |" in markdown  # memory: hivemind / native
    assert "| failed |" in markdown
    assert "- `peer bench x --backend hivemind`: Boom: x" in markdown
    assert "All-reduce" not in markdown  # parts not run get no table


def test_bad_arguments_exit_2_with_one_line():
    for bad in (["--parts", "nope"], ["--sizes", "1,x"], ["--allreduce-peers", "1"]):
        done = _run([sys.executable, "-m", "peer", "bench", "compare", *bad], timeout_s=60)
        assert done.returncode == 2, (bad, done.stderr)
        assert "Traceback" not in done.stderr


def test_paired_row_takes_turns_and_reports_the_median_of_pairwise_ratios():
    order, rates = [], {"native": iter([900.0, 1000.0, 700.0]), "hivemind": iter([100.0] * 3)}

    def measure(backend: str) -> Cell:
        order.append(backend)
        value = next(rates[backend])
        return Cell(backend, f"x --backend {backend}", result={"samples_per_s": value})

    native, hive = paired_row(
        "train", 3, {b: (lambda b=b: measure(b)) for b in ("native", "hivemind")}
    )
    assert order == ["native", "hivemind", "hivemind", "native", "native", "hivemind"]
    assert native.result == {"samples_per_s": 900.0}  # the run with the median value
    assert native.runs == [{"samples_per_s": v} for v in (900.0, 1000.0, 700.0)]
    assert native.ratio == hive.ratio
    assert native.ratio["ratios"] == [9.0, 10.0, 7.0] and native.ratio["ratio_p50"] == 9.0
    assert native.ratio["ratio_iqr"] == pytest.approx(1.5)  # quartiles 8.0 and 9.5
    row = [dataclasses.asdict(c) | {"result": c.result | TRAIN} for c in (native, hive)]
    markdown = render_markdown({"machine": MACHINE, "allreduce": [], "train": [row], "dht": []})
    assert "| 9.00x (IQR 1.50, 3 pairs) |" in markdown


def test_paired_allreduce_reports_the_other_backend_and_the_ratio_spread():
    mine, theirs = iter([0.10, 0.12, 0.11]), iter([0.40, 0.36, 0.55])
    result = paired_allreduce(
        lambda: {"backend": "native", "round_s_p50": next(mine)},
        lambda: {"backend": "hivemind", "round_s_p50": next(theirs)},
        num_pairs=3,
    )
    assert result["backend"] == "native" and result["round_s_p50"] == 0.11
    assert result["runs_round_s_p50"] == [0.10, 0.12, 0.11] and result["pairs"] == 3
    compare = result["compare"]
    assert compare["backend"] == "hivemind" and compare["round_s_p50"] == 0.40
    assert compare["ratios"] == [4.0, 3.0, 5.0] and compare["ratio_p50"] == 4.0
    assert (compare["ratio_min"], compare["ratio_max"], compare["num_pairs"]) == (3.0, 5.0, 3)
