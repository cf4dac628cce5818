"""Start library peers as real processes on loopback and collect what they report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.child import python_path

ROOT = Path(__file__).resolve().parents[2]


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    """``python ARGS`` from the repository root, stdout piped (text), stderr kept apart."""
    # one torch thread per process: several peers share the machine's cores
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = python_path(ROOT)
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def first_line(process: subprocess.Popen) -> str:
    """The first line of a process's stdout (its URL); fails with its stderr if it died."""
    line = process.stdout.readline().strip()
    if not line:
        process.wait(timeout=30)
        raise AssertionError(f"no output; stderr:\n{process.stderr.read()}")
    return line


def finish(process: subprocess.Popen, timeout_s: float) -> str:
    """Wait for a clean exit; its stderr (for messages); kills it on timeout."""
    try:
        _, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"timed out; stderr:\n{err[-4000:]}") from None
    assert process.returncode == 0, f"exit {process.returncode}; stderr:\n{err[-4000:]}"
    return err
