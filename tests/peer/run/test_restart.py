"""A peer process killed with SIGKILL and restarted with the same --checkpoint-dir resumes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from peer.run.runner import PeerRun
from tests.peer.run.test_join import config

pytestmark = pytest.mark.timeout(180)


def join_command(*extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "peer",
        "join",
        "--task-option",
        "hidden_dim=64",
        "--task-option",
        "num_eval_batches=0",
        "--torch-threads",
        "1",
        "--target-batch-size",
        "256",
        "--seed",
        "7",
        *extra,
    ]


def checkpoint_epochs(directory) -> list[int]:
    from peer.train.checkpoint import CheckpointDir

    return [int(re.findall(r"\d+", path.name)[0]) for path in CheckpointDir(directory).paths()]


def test_a_killed_peer_resumes_from_its_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    first = subprocess.Popen(
        join_command(
            "--checkpoint-dir", str(directory), "--checkpoint-interval", "0.2", "--max-time", "120"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not directory.exists() or len(list(directory.glob("*.safetensors"))) < 2:
            assert time.monotonic() < deadline and first.poll() is None, "no checkpoints"
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    from peer.train.checkpoint import CheckpointDir

    run = PeerRun(config(task_option=["hidden_dim=64", "num_eval_batches=0"]))
    saved = CheckpointDir(directory).load_latest(model=run.model, optimizer=run.optimizer)
    assert saved is not None and saved.progress.epoch >= 1
    second = subprocess.run(
        join_command("--checkpoint-dir", str(directory), "--max-time", "2", "--json"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"at epoch {saved.progress.epoch}" in second.stderr  # "resumed from ... at epoch N"
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["epoch"] >= saved.progress.epoch
