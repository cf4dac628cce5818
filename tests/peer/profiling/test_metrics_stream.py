"""The metrics stream of a real peer: the DESIGN.md fields, per-interval numbers that add up."""

from __future__ import annotations

import json

import pytest
import torch

from peer.profiling.phases import PHASES
from peer.run.runner import PeerRun
from tests.peer.run.test_join import config

pytestmark = pytest.mark.timeout(120)
FIELDS = {
    "t",
    "peer",
    "run",
    "epoch",
    "step",
    "loss",
    "samples",
    "samples_per_s",
    "phases",
    "net",
    "cpu_percent",
    "rss_bytes",
}


def test_metrics_lines_have_the_contract_fields_and_add_up(tmp_path):
    path = tmp_path / "metrics.jsonl"
    run = PeerRun(config(seed=3, max_time=2.0, metrics_file=path, metrics_interval=0.3))
    summary = run.run()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) >= 3
    for line in lines:
        # "gpu" only where there is one
        assert set(line) == FIELDS | ({"gpu"} if torch.cuda.is_available() else set())
        assert set(line["phases"]) == set(PHASES)
        assert line["peer"] == summary.peer_id and line["run"] == "vp-run"
        assert {"sent", "recv"} <= set(line["net"]) <= {"sent", "recv", "rtt_ms"}
    assert sum(line["samples"] for line in lines) == summary.num_samples
    assert lines[-1]["step"] == summary.num_steps and lines[-1]["epoch"] == summary.epoch
    # every second of each interval is in some phase; the training phases dominate (with the
    # time the training thread waited for a CPU on a loaded machine)
    for line in lines[1:]:
        if not line["samples"]:
            continue  # the closing line can follow the last full interval by a moment
        wall_s = sum(line["phases"].values())
        assert wall_s == pytest.approx(line["samples"] / line["samples_per_s"], rel=1e-6)
        training = ("data", "forward", "backward", "optimizer", "cpu_wait")
        compute_s = sum(line["phases"][p] for p in training)
        assert compute_s > 0.5 * wall_s
