"""Checks on two peers' announced state digests (``StateServer.digests``)."""

from __future__ import annotations

from collections.abc import Sequence


def assert_equal_lately(digests: Sequence[dict[int, str]], context: object = None) -> None:
    """Two peers' replicas were equal at the last (up to 8) epochs both digested, at least 4
    of them spanning at least 6 epochs: bit for bit (a digest hashes the whole state).

    Each peer keeps its last 16 digests; with the digest schedule's stride they span more
    epochs and fewer are common to both peers, so the check counts epochs, not a fixed 8.
    """
    first, second = digests
    common = sorted(set(first) & set(second))
    recent = common[-8:]
    details = context if context is not None else [sorted(d) for d in digests]
    assert len(recent) >= 4 and recent[-1] - recent[0] >= 6, (recent, details)
    assert all(first[e] == second[e] for e in recent), [
        (e, first[e][:6], second[e][:6]) for e in common
    ]
