"""Three real peer processes; one is killed with SIGKILL in the middle of an all-reduce; the
other two finish that round without it and go on training and averaging with each other."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peer.run.processes import bootstrap_dht, stop_processes

pytestmark = pytest.mark.timeout(240)
# A 1.9M-parameter model and a target of two local batches: the peers spend most of their time
# in rounds, so the kill lands in one (or between two rounds a few milliseconds apart).
HIDDEN = 1024
NUM_PARAMS = 784 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10


def peer_command(url: str, seed: int, metrics: Path, *, crash: bool = False) -> list[str]:
    program = [str(Path(__file__).with_name("crashing_peer.py"))] if crash else ["-m", "peer"]
    return [
        sys.executable, *program, "--log-level", "WARNING", "join",
        "--initial-peers", url,
        "--task-option", f"hidden_dim={HIDDEN}",
        "--task-option", "num_eval_batches=0",
        "--target-batch-size", "64",
        "--torch-threads", "1",
        "--seed", str(seed),
        "--max-time", "30",
        "--wait-for-peers", "3",
        "--matchmaking-time", "2",
        "--averaging-timeout", "5",
        "--metrics-file", str(metrics),
        "--metrics-interval", "0.5",
        "--json",
    ]  # fmt: skip


def metrics_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_a_peer_killed_mid_round_does_not_stop_the_others(tmp_path):
    peers: list[subprocess.Popen] = []
    with bootstrap_dht() as url:
        try:
            files = [tmp_path / f"peer{i}.jsonl" for i in range(3)]
            # the victim dies sending a part of its fifth round or so (2/3 of its vector per round)
            environment = {**os.environ, "VP_TEST_CRASH_AFTER_BYTES": str(3 * NUM_PARAMS * 4)}
            peers = [
                subprocess.Popen(
                    peer_command(url, i + 1, files[i], crash=i == 2),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=environment,
                )
                for i in range(3)
            ]
            victim, survivors = peers[2], peers[:2]
            assert victim.wait(timeout=150) == -signal.SIGKILL
            epoch_at_kill = max(
                (line["epoch"] for f in files[:2] for line in metrics_lines(f)), default=0
            )
            lines_at_kill = [len(metrics_lines(f)) for f in files[:2]]
            outputs = [peer.communicate(timeout=150) for peer in survivors]
        finally:
            stop_processes(peers)
    # the round the victim died in ended without it, for at least one survivor
    dropped = re.compile(r"averaging round \S+ (partial|failed).*dropped (?!nobody)")
    assert any(dropped.search(stderr) for _, stderr in outputs), [e[-1500:] for _, e in outputs]
    for peer, (stdout, stderr) in zip(survivors, outputs, strict=True):
        assert peer.returncode == 0, stderr[-2000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["stopped_by"] == "max_time"
        assert summary["epoch"] >= epoch_at_kill + 3, (summary, epoch_at_kill)
    # after the kill the two survivors still averaged: in a group of two each sends the other
    # half of its 4-byte values per round, so three rounds move at least this much
    for path, start in zip(files[:2], lines_at_kill, strict=True):
        sent_after = sum(line["net"]["sent"] for line in metrics_lines(path)[start:])
        assert sent_after >= 3 * NUM_PARAMS * 4 / 2, sent_after
