"""A newcomer meets a swarm whose epochs are shorter than a round's matchmaking wait (issue 24,
items 4 and 8): three `peer join` processes step an epoch every few tenths of a second; a fourth
peer (in this process, to read its rounds) downloads their state and must average with them
within a few rounds, instead of entering every round at an epoch they have just left and
waiting out the whole matchmaking time there alone. It arrives at the epoch after the one
whose round is about to start, counted in that epoch's ``expected_peers`` from its beginning
(:mod:`peer.swarm.arrival`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from peer.run.runner import PeerRun
from tests.peer.run.processes import bootstrap_dht, join_logged, stop_processes
from tests.peer.run.test_join import config, stop, train_in_thread, wait_for

pytestmark = pytest.mark.timeout(150)
# 8192 samples per epoch over three peers of batch 32: epochs of a few tenths of a second,
# far shorter than the matchmaking wait (10 s) a round that finds nobody sits out
FAST = {"target_batch_size": 8192, "publish_interval": 0.1}
# rounds the newcomer may spend alone before its first round with the swarm (each one a
# round it entered at an epoch the swarm had just left, or one before its download)
MAX_ROUNDS_BEFORE_MEETING = 4


def swarm_peer(url: str, seed: int, files: Path) -> subprocess.Popen:
    return join_logged(
        url, seed, files,
        "--task-option", "hidden_dim=64",
        "--target-batch-size", str(FAST["target_batch_size"]),
        "--publish-interval", str(FAST["publish_interval"]),
        "--max-time", "120",
        "--wait-for-peers", "3",
        "--matchmaking-time", "10",
        "--averaging-timeout", "20",
        "--metrics-file", str(files / f"peer{seed}.jsonl"),
        "--metrics-interval", "0.5",
    )  # fmt: skip


def test_a_newcomer_averages_with_a_swarm_of_short_epochs_within_a_few_rounds(tmp_path):
    peers: list[subprocess.Popen] = []
    with bootstrap_dht() as url:
        newcomer, thread = None, None
        try:
            peers = [swarm_peer(url, seed, tmp_path) for seed in (1, 2, 3)]
            wait_for(
                lambda: all(swarm_epoch(tmp_path / f"peer{s}.jsonl") >= 3 for s in (1, 2, 3)),
                "the swarm did not reach epoch 3",
                90,
            )
            newcomer = PeerRun(config(seed=4, initial_peers=[url], **FAST))
            newcomer.start()  # downloads the swarm's state
            assert newcomer.hook.epoch >= 2
            thread = train_in_thread(newcomer)
            stats = newcomer.hook.stats
            wait_for(
                lambda: met(stats.history) or stats.num_rounds >= MAX_ROUNDS_BEFORE_MEETING + 1,
                "the newcomer finished no round",
                90,
            )
            history = list(stats.history)
            summary = [(r.epoch, r.status, r.num_peers, r.reason[:60]) for r in history]
            assert met(history[: MAX_ROUNDS_BEFORE_MEETING + 1]), summary
            # and it stays with them: most of its later rounds are with the swarm
            first = next(i for i, r in enumerate(history) if r.ok and r.num_peers >= 2)
            wait_for(lambda: stats.num_rounds >= first + 6, "the newcomer stopped averaging", 60)
            later = list(stats.history)[first : first + 6]
            assert sum(r.ok and r.num_peers >= 2 for r in later) >= 4, [
                (r.epoch, r.status, r.num_peers) for r in later
            ]
        finally:
            if newcomer is not None:
                stop(newcomer, thread)
            stop_processes(peers)


def met(history) -> bool:
    return any(r.ok and r.num_peers >= 2 for r in history)


def swarm_epoch(path: Path) -> int:
    """The last epoch a swarm peer wrote to its metrics file (-1 before its first line)."""
    if not path.exists():
        return -1
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["epoch"] if lines else -1
