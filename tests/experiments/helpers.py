"""Shared helpers of the experiments tests: writing specs, running the CLI, reading streams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def peer_cli(*args: str, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """``python -m peer ARGS`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "peer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        **kwargs,
    )


def tiny_spec(name: str, *, launcher: str = "local", extra: str = "", stop: str = "") -> str:
    """A spec of a tiny synthetic task on one torch thread per peer."""
    return f"""
name = "{name}"
launcher = "{launcher}"
seeds = [0]
metrics_interval_s = 0.5
{extra}

[task]
name = "synthetic"
options = {{ hidden_dim = 32, input_dim = 64 }}

[train]
peers = 2
batch_size = 32
lr = 0.003
target_batch_size = 256

[resources]
total_cpus = 2
pin_cpus = false
# OpenMP threads that spin while waiting starve each other on a loaded 2-core machine
env = {{ OMP_WAIT_POLICY = "PASSIVE" }}

[stop]
{stop or "max_time_s = 5"}
timeout_s = 90
"""


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
