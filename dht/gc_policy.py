"""The garbage collector's policy for a long-running peer or node process.

A process of ``peer bench swarm`` (32 light peers on one loop) holds about 260,000 objects
that live as long as it does: sockets, connections, routing tables, records. CPython's default
thresholds (700, 10, 10) ran a full collection over all of them about every 2 s, and the young
collections every 700 allocations: together 20-25% of the process's CPU at 64 peers (measured
with ``gc.callbacks``). A ``peer join`` process adds torch's own objects to every full walk.

So a process that has started (:func:`settle`) freezes what it holds (the collector never walks
those objects again; they are not garbage, they are the process) and collects the young
generation every :data:`YOUNG_THRESHOLD` allocations instead: a few milliseconds of walking
per 50,000 allocations rather than per 700, and full collections far apart. Objects without
reference cycles are freed by reference counting as before; only cyclic garbage waits longer
(a few MB at most). The training baseline of ``peer bench train`` takes the same policy, so its
ratio measures the peer's machinery, not the collector. A ``peer join`` of the hivemind backend
keeps the defaults: hivemind's own processes and finalizers were not measured under it.
"""

from __future__ import annotations

import gc

# Allocations (less deallocations) between collections of the youngest generation.
YOUNG_THRESHOLD = 50_000
# Young collections per collection of the middle generation, and middle ones per full one.
MIDDLE_THRESHOLD = 20
OLD_THRESHOLD = 100


def settle() -> None:
    """Call once the process has started (imports done, servers up): collect, freeze what
    survives, and raise the thresholds. Safe to call again (later survivors are frozen too)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
