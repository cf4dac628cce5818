"""What a round weighs each peer by, for the tests whose single-process reference stands for
"two peers equal one process over the union of their batches" (tests/api/test_union.py,
tests/peer/run/test_join.py)."""

from __future__ import annotations

from averaging.config import AveragerConfig


def round_weights(samples: list[int]) -> list[float]:
    """Each peer's weight in a round, as every member of the group uses it: its samples, capped
    at ``max_weight_ratio`` times the lower median of the group's (averaging/bounds.py, against
    a member claiming a huge weight). Within that ratio of each other, peers weigh exactly their
    samples; a peer that entered the epoch late with one batch, beside one that gathered ten,
    is not (under load, a round of 160 samples against 16: the 160 count as 128)."""
    ratio = AveragerConfig().max_weight_ratio  # the peers' (peer.run.config leaves the default)
    positive = sorted(s for s in samples if s > 0)
    cap = ratio * positive[(len(positive) - 1) // 2]
    return [min(float(s), cap) for s in samples]
