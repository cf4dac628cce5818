"""``peer join`` started early and held, its imports done, until the test gives the cue (a
file appears): a newcomer that joins a running swarm at a chosen moment, however long the
interpreter takes to import torch on a loaded machine. Exits 3 if no cue comes in time.

Usage: ``python -m tests.experiments.cued_join PEER-ARGS...`` with ``VP_TEST_CUE=/path/file``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import peer.run.runner  # noqa: F401  (the slow imports, before the cue)
from peer.cli.main import main

CUE_TIMEOUT_S = 180.0

if __name__ == "__main__":
    cue = Path(os.environ["VP_TEST_CUE"])
    deadline = time.monotonic() + CUE_TIMEOUT_S
    while not cue.exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    sys.exit(main(sys.argv[1:]))
