"""Rounds paced within the request share each peer's server grants another (issue 24's shared
pools, seen from the honest side): two ``peer join`` processes at a one-batch target, a model
so small that a step takes about a millisecond. Unpaced, they ran some 80 rounds a second, each
sending the other about 4 requests a round, past the 200 a second its server grants one peer:
refusals (429), partial and failed rounds, replicas apart and re-synced. ``--min-round-interval``
(0.05 s by default) starts a peer's rounds with others at least that far apart, the epoch
gathering on meanwhile."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.peer.run.processes import bootstrap_dht, join_logged, stop_processes

pytestmark = pytest.mark.timeout(150)
NUM_EPOCHS = 200
# what a peer logs when another peer's requests were refused, or a round missed a peer
TROUBLE = re.compile(r"refused|averaging round \S+ (partial|failed|alone)|re-sync")
# a request that reaches a peer already closing (the first to finish stops its node while the
# other still asks it): shutdown, not a round's refusal (a CI run saw one, after both had trained)
CLOSING = "this DHT node is closed"


def join(url: str, seed: int, files: Path) -> subprocess.Popen:
    return join_logged(
        url, seed, files,
        "--task-option", "hidden_dim=8",
        "--target-batch-size", "32",
        "--max-epochs", str(NUM_EPOCHS),
        "--wait-for-peers", "2",
    )  # fmt: skip


def test_two_peers_at_a_one_batch_target_average_every_round_without_refusals(tmp_path):
    peers: list[subprocess.Popen] = []
    with bootstrap_dht() as url:
        try:
            peers = [join(url, seed, tmp_path) for seed in (1, 2)]
            codes = [peer.wait(timeout=120) for peer in peers]
        finally:
            stop_processes(peers)
    logs = {seed: (tmp_path / f"peer{seed}.log").read_text() for seed in (1, 2)}
    assert codes == [0, 0], logs
    trouble = [
        line
        for log in logs.values()
        for line in log.splitlines()
        if TROUBLE.search(line) and CLOSING not in line
    ]
    assert not trouble, trouble
