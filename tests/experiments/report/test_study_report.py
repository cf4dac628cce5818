"""The report's study sections against numbers known by construction: metrics streams written
here with set rates and set moments of reaching the target loss, over two seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.report.writer import write_report
from peer.records.profile import PROFILE_PHASES

pytestmark = pytest.mark.timeout(60)
T0 = 1_800_000_000.0
NUM_LINES = 15
SPEC = """
name = "study-test"
seeds = [0, 1]
[task]
name = "synthetic"
[train]
peers = 2
[grid]
target_batch_size = [128, 512]
[resources]
total_cpus = 2
pin_cpus = false
[stop]
max_time_s = 15
target_loss = 1.0
"""
# config -> (samples per line per process, seconds to the target loss per seed, processes)
RUNS = {
    "baseline": (1000, {0: 10, 1: 11}, 1),
    "target_batch_size-128": (700, {0: 5, 1: 6}, 2),
    "target_batch_size-512": (400, {0: 9, 1: 12}, 2),
}


def write_stream(path: Path, peer: str, samples: int, reach_s: int) -> None:
    """One line a second, each second in forward/backward/data; loss 3 until ``reach_s`` - 1
    s, then 0: with the report's 3-line window the swarm's loss is 1.0 at ``reach_s``."""
    lines = []
    for number in range(NUM_LINES):
        elapsed_s = number + 1
        phases = dict.fromkeys(PROFILE_PHASES, 0.0) | {"forward": 0.5, "backward": 0.3}
        phases["data"] = 0.2
        lines.append(
            {
                "t": T0 + number, "peer": peer, "run": "r", "epoch": number, "step": number,
                "loss": 0.0 if elapsed_s >= reach_s - 1 else 3.0, "samples": samples,
                "samples_per_s": float(samples), "phases": phases,
                "net": {"sent": 0, "recv": 0}, "cpu_percent": 100.0, "rss_bytes": 1,
            }
        )  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def make_sweep(out: Path, seeds=(0, 1)) -> None:
    out.mkdir()
    (out / "spec.toml").write_text(SPEC.replace("[0, 1]", str(list(seeds))))
    for key, (samples, reach, processes) in RUNS.items():
        for seed in seeds:
            name = f"{key}_seed-{seed}"
            directory = out / name
            directory.mkdir()
            baseline = key == "baseline"
            grid = {} if baseline else {"target_batch_size": int(key.rpartition("-")[2])}
            described = {"name": name, "seed": seed, "baseline": baseline, "grid": grid}
            (directory / "config.json").write_text(json.dumps(described))
            status = {"status": "done", "load_average": [1.0 + seed, 1.5]}
            (directory / "status.json").write_text(json.dumps(status))
            for index in range(processes):
                peer = "baseline" if baseline else f"peer-{index}"
                write_stream(directory / f"{peer}.jsonl", peer, samples, reach[seed])


def section(report: str, title: str) -> str:
    return report.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def table(text: str) -> dict[str, dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_spreads_noise_fairness_and_findings(tmp_path: Path):
    out = tmp_path / "sweep"
    make_sweep(out)
    report = write_report(out).read_text()
    assert "**not calibrated**" in section(report, "The baseline")
    # 2 peers x 700 samples/s on 2 CPUs = 700 per CPU; the baseline 1000 on 2 = 500 (1.40x).
    fairness = section(report, "Fairness")
    assert "**baseline suspect**: `target_batch_size-128` trained 700.0 [700.0-700.0]" in fairness
    assert "the baseline 500.0 [500.0-500.0] (1.40x > 1.20x)" in fairness
    assert "target_batch_size-512" not in fairness  # 400 per CPU
    rows = table(section(report, "Study: seeds pooled"))
    assert rows["baseline"]["time to target s"] == "10.5 [10.0-11.0]"
    assert rows["target_batch_size-128"]["time to target s"] == "5.5 [5.0-6.0]"
    assert rows["target_batch_size-128"]["vs baseline"] == "faster"
    assert rows["target_batch_size-512"]["vs baseline"] == "noise"  # [9, 12] meets [10, 11]
    # speedup per seed: 10/5 and 11/6
    assert rows["target_batch_size-128"]["speedup"] == f"{(2 + 11 / 6) / 2:.2f} [1.83-2.00]"
    # samples to target: every process's samples up to the reaching line (seed 0: 5 lines x 2)
    assert rows["target_batch_size-128"]["samples to target"].startswith("7700 [7000-8400]")
    assert rows["target_batch_size-128"]["data %"] == "20.0 [20.0-20.0]"
    assert rows["target_batch_size-128"]["reached"] == "2/2"
    assert "Machine load (1-minute load average at each configuration's start and end): " in report
    assert "1.0-2.0 on" in report
    # speedup = fewer samples x faster samples/s: seed 0 10000/7000 x (7000/5)/(10000/10)
    split = table(section(report, "Where the speedup comes from"))["target_batch_size-128"]
    statistical = (10000 / 7000 + 11000 / 8400) / 2
    assert split["x fewer samples"] == f"{statistical:.2f} [1.31-1.43]"
    assert split["x faster samples/s"] == "1.40 [1.40-1.40]"
    assert split["speedup"] == rows["target_batch_size-128"]["speedup"]
    assert split["mostly from"] == "throughput"
    findings = section(report, "Findings")
    ratio = ((9 + 12) / 2) / ((5 + 6) / 2)
    assert "1. **target_batch_size** moved time to target most" in findings
    assert f"({ratio:.2f}x; beyond the seeds' spread)" in findings
    assert "`target_batch_size-128`, reached the target with a speedup of 1.92" in findings


def test_one_seed_says_its_spread_is_unknown(tmp_path: Path):
    out = tmp_path / "sweep"
    make_sweep(out, seeds=(0,))
    report = write_report(out).read_text()
    rows = table(section(report, "Study: seeds pooled"))
    assert rows["target_batch_size-512"]["vs baseline"] == "faster (1 seed)"
    assert rows["baseline"]["time to target s"] == "10.0"
    assert "one seed: spread unknown" in section(report, "Findings")
