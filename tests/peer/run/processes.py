"""The ``peer`` processes the run tests start on loopback, and their cleanup."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path


@contextlib.contextmanager
def bootstrap_dht() -> Iterator[str]:
    """A ``peer dht`` process: yields its URL; killed on exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "peer", "dht"], stdout=subprocess.PIPE, text=True
    )
    try:
        yield process.stdout.readline().strip()
    finally:
        stop_processes([process])


def stop_processes(processes: Iterable[subprocess.Popen]) -> None:
    """Kill those still running and reap them."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def join_logged(url: str, seed: int, files: Path, *flags: str) -> subprocess.Popen:
    """``peer join`` on the synthetic task (no eval batches) and one torch thread, bootstrapping
    from ``url``, with ``flags``; its log (WARNING and up) in ``files/peer<seed>.log``."""
    command = [
        sys.executable, "-m", "peer", "--log-level", "WARNING", "join",
        "--initial-peers", url,
        "--task-option", "num_eval_batches=0",
        "--torch-threads", "1",
        "--seed", str(seed),
        *flags,
    ]  # fmt: skip
    log = (files / f"peer{seed}.log").open("w")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
