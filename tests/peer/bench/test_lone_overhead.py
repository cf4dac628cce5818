"""``python -m peer.bench.lone_overhead``: a lone peer against a plain loop, in microseconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_lone_overhead_prints_its_fields_for_a_few_short_blocks(tmp_path):
    command = [sys.executable, "-m", "peer.bench.lone_overhead", "--threads", "1"]
    command += ["--blocks", "2", "--steps", "20", "--target-batch-size", "256"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=100, check=True, env=env
    )
    # its metrics directory went with it (torch keeps a cache of its own there)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("vp-")] == []
    fields = json.loads(result.stdout.strip().splitlines()[-1])
    assert fields["num_pairs"] == 2 and fields["steps_per_block"] == 20
    assert fields["step_us_plain"] > 0 and fields["step_us_peer"] > 0
    assert fields["overhead_us_q25"] <= fields["overhead_us_p50"] <= fields["overhead_us_q75"]
    assert fields["ratio_p50"] > 0
    assert set(fields["other_threads_cpu_us_per_step"]) == {"plain", "peer"}
    assert set(fields["main_cpu_us_per_step"]) == {"plain", "peer"}
    assert min(fields["main_cpu_us_per_step"].values()) > 0  # the training thread's CPU time
    q25, p50, q75 = (fields[f"main_cpu_overhead_us_{q}"] for q in ("q25", "p50", "q75"))
    assert q25 <= p50 <= q75
    assert "other_threads_cpu_overhead_us_p50" in fields
    # 200 warm-up steps and 40 measured ones of 32 samples, 256 per epoch: about 30 epochs
    assert fields["epochs"] >= 20
