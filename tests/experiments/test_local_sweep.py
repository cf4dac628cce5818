"""``peer experiment run`` on the local launcher end to end: two swarm configurations and the
baseline, the report's numbers recomputed from the metrics files, skipping and failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.experiments.helpers import peer_cli, read_lines, tiny_spec

pytestmark = pytest.mark.timeout(300)

TARGET_LOSS = 2.0


def summary_rows(report: str) -> dict[str, dict[str, str]]:
    """The rows of report.md's Summary table, by config."""
    section = report.split("## Summary", 1)[1].split("##", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def expected_numbers(config_dir: Path) -> dict[str, float]:
    """What the report must say, computed here straight from the JSON Lines."""
    peers = {path.stem: read_lines(path) for path in sorted(config_dir.glob("*.jsonl"))}
    samples = sum(line["samples"] for lines in peers.values() for line in lines)
    walls = [sum(sum(line["phases"].values()) for line in lines) for lines in peers.values()]
    wall_s = sum(walls) / len(walls)
    last_losses = []
    for lines in peers.values():
        losses = [line["loss"] for line in lines if line["loss"] is not None][-3:]
        last_losses.append(sum(losses) / len(losses))
    # the swarm's loss curve: each peer's mean of its last 3 losses, averaged, at every line
    start_t = min(lines[0]["t"] - sum(lines[0]["phases"].values()) for lines in peers.values())
    events = sorted((line["t"], peer, line["loss"]) for peer, ls in peers.items() for line in ls)
    recent: dict[str, list[float]] = {}
    time_to_target = None
    for t, peer, loss in events:
        if loss is not None:
            recent[peer] = [*recent.get(peer, []), loss][-3:]
        if recent and time_to_target is None:
            swarm = sum(sum(v) / len(v) for v in recent.values()) / len(recent)
            if swarm <= TARGET_LOSS:
                time_to_target = t - start_t
    sent = sum(line["net"]["sent"] for lines in peers.values() for line in lines)
    rounds = max(lines[-1]["epoch"] for lines in peers.values())
    return {
        "peers": len(peers),
        "samples": samples,
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s,
        "final_loss": sum(last_losses) / len(last_losses),
        "rounds": rounds,
        "sent_per_peer_round": sent / len(peers) / rounds if rounds else None,
        "time_to_target_s": time_to_target,
    }


def test_two_configurations_and_the_baseline_end_to_end(tmp_path: Path):
    spec = tmp_path / "spec.toml"
    spec.write_text(
        tiny_spec(
            "e2e",
            extra="[grid]\ntarget_batch_size = [128, 512]\n",
            stop=f"max_time_s = 5\ntarget_loss = {TARGET_LOSS}",
        )
    )
    out = tmp_path / "out"
    result = peer_cli("experiment", "run", str(spec), "--out", str(out), timeout_s=240)
    assert result.returncode == 0, result.stderr[-3000:]
    names = ["baseline_seed-0", "target_batch_size-128_seed-0", "target_batch_size-512_seed-0"]
    for name in names:
        status = json.loads((out / name / "status.json").read_text())
        assert status["status"] == "done", status
    for name in names[1:]:
        assert sorted(p.name for p in (out / name).glob("*.jsonl")) == [
            "peer-0.jsonl",
            "peer-1.jsonl",
        ]
        assert (out / name / "peer-0.log").stat().st_size > 0

    report = (out / "report.md").read_text()
    rows = summary_rows(report)
    assert set(rows) == set(names)
    baseline = expected_numbers(out / names[0])
    for name in names:
        expected, row = expected_numbers(out / name), rows[name]
        assert int(row["peers"]) == expected["peers"] == (1 if name == names[0] else 2)
        assert int(row["samples"]) == expected["samples"] > 0
        assert float(row["wall_s"]) == pytest.approx(expected["wall_s"], abs=0.051)
        assert float(row["samples_per_s"]) == pytest.approx(expected["samples_per_s"], abs=0.051)
        assert float(row["final_loss"]) == pytest.approx(expected["final_loss"], abs=6e-5)
        assert int(row["rounds"]) == expected["rounds"]
        ttt = None
        if expected["time_to_target_s"] is None:
            assert row["time_to_target_s"] == "-"
        else:
            ttt = float(row["time_to_target_s"])
            assert ttt == pytest.approx(expected["time_to_target_s"], abs=0.051)
        if name != names[0] and None not in (ttt, baseline["time_to_target_s"]):
            speedup = baseline["time_to_target_s"] / expected["time_to_target_s"]
            assert float(row["speedup"]) == pytest.approx(speedup, abs=0.006)  # 2 digits
        if name != names[0]:
            ratio = expected["samples_per_s"] / baseline["samples_per_s"]
            assert float(row["throughput_ratio"]) == pytest.approx(ratio, abs=0.006)
            if expected["sent_per_peer_round"] is not None:
                assert float(row["sent_bytes_per_peer_round"]) == pytest.approx(
                    expected["sent_per_peer_round"], abs=1
                )
    for name in names:
        status = json.loads((out / name / "status.json").read_text())
        if status["stopped_by"] == "target_loss":  # stopped by the rule: the loss got there
            assert rows[name]["time_to_target_s"] != "-"
    plots = ["loss_vs_time", "loss_vs_samples", "throughput", "phases", "bytes_per_round"]
    if any(row["time_to_target_s"] != "-" for row in rows.values()):
        plots.append("time_to_target")
    for plot in plots:
        data = (out / "plots" / f"{plot}.png").read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, plot
        assert f"plots/{plot}.png" in report
    csv_lines = (out / "tables" / "summary.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(names)
    assert (out / "tables" / "phases.csv").exists()

    # a second run skips what is finished; --force would rerun it
    mtime = (out / names[1] / "status.json").stat().st_mtime
    again = peer_cli("experiment", "run", str(spec), "--out", str(out), timeout_s=60)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("skipped") == len(names)
    assert (out / names[1] / "status.json").stat().st_mtime == mtime

    # the report command alone writes the same table
    (out / "report.md").unlink()
    assert peer_cli("experiment", "report", str(out), timeout_s=60).returncode == 0
    assert summary_rows((out / "report.md").read_text()) == rows


def test_a_failed_configuration_is_marked_and_the_sweep_goes_on(tmp_path: Path):
    spec = tmp_path / "spec.toml"
    spec.write_text(
        tiny_spec(
            "failing",
            extra='baseline = false\n[grid]\njoin_args = [["--no-such-flag"], []]\n',
            stop="max_time_s = 3",
        )
    )
    out = tmp_path / "out"
    result = peer_cli("experiment", "run", str(spec), "--out", str(out), timeout_s=200)
    assert result.returncode == 1, result.stderr[-3000:]
    failed = json.loads((out / "join_args-no-such-flag_seed-0" / "status.json").read_text())
    assert failed["status"] == "failed"
    assert "exited with 2" in failed["reason"] and "no-such-flag" in failed["reason"]
    done = json.loads((out / "join_args-none_seed-0" / "status.json").read_text())
    assert done["status"] == "done", done
    report = (out / "report.md").read_text()
    assert "## Failed or unfinished configurations" in report
    assert "join_args-no-such-flag_seed-0" in report.split("## Failed", 1)[1]
