"""The collector's policy of a started process (dht.gc_policy), in a process of its own: it
changes process-wide state that the test runner's own process must keep."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dht.gc_policy import MIDDLE_THRESHOLD, OLD_THRESHOLD, YOUNG_THRESHOLD

pytestmark = pytest.mark.timeout(60)

PROGRAM = """
import gc, json
from dht.gc_policy import settle

class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it

kept = [Node() for _ in range(100_000)]  # what a started process holds for good
settle()
walked = len(gc.get_objects())  # what a full collection walks from now on
for _ in range(1000):
    Node()  # cyclic garbage made after the start
freed = gc.collect()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "walked": walked, "freed": freed, "kept": len(kept)}))
"""


def test_a_started_process_is_frozen_and_its_later_cyclic_garbage_still_freed():
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=50, check=True
    )
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(facts["threshold"]) == (YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
    # the 100,000 objects held at the start are never walked again...
    assert facts["frozen"] >= 100_000
    assert facts["walked"] < 100_000
    # ... while the cycles made afterwards are still collected
    assert facts["freed"] >= 1000
    assert facts["kept"] == 100_000
