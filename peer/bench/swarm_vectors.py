"""The stand-in for training of ``peer bench swarm``: each peer's rate and each epoch's
"gradient", both derived from (seed, rank, epoch) so that the parent process can recompute any
peer's vector and check the averaged result against the exact weighted mean in float64."""

from __future__ import annotations

import numpy as np


def peer_rate(seed: int, rank: int, samples_per_s: float) -> float:
    """Peer ``rank``'s samples per second: ``samples_per_s`` times a factor in [0.5, 1.5) (peers
    are not equally fast, so weights differ and a mean that ignored them would show)."""
    rng = np.random.default_rng([seed, rank, 1])
    return samples_per_s * float(rng.uniform(0.5, 1.5))


def peer_vector(seed: int, rank: int, epoch: int, size: int) -> np.ndarray:
    """Peer ``rank``'s float32 "gradient" at ``epoch``: a signal shared by every peer of the
    epoch plus noise of its own, both standard normal: a replica that missed the average is
    about the mean's norm away from it (a relative distance near 1), one averaged with g
    others about 1/sqrt(g) of it."""
    shared = np.random.default_rng([seed, epoch, 2]).standard_normal(size)
    own = np.random.default_rng([seed, epoch, 3, rank]).standard_normal(size)
    return (shared + own).astype(np.float32)


def exact_weighted_mean(seed: int, size: int, epoch: int, weights: dict[int, float]) -> np.ndarray:
    """The weighted mean in float64 of the vectors of the ranks in ``weights`` at ``epoch``."""
    total = np.zeros(size, dtype=np.float64)
    for rank, weight in weights.items():
        total += weight * peer_vector(seed, rank, epoch, size).astype(np.float64)
    return total / sum(weights.values())
