"""The progress record (``{run_id}/progress``): one peer's epoch, samples and rate, and its parser.

Torch-free, like everything in :mod:`peer.records`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dht.validation import subkey_owner

PROGRESS_KEY_SUFFIX = "progress"


def progress_key(run_id: str) -> str:
    """The DHT key of a run's progress records."""
    return f"{run_id}/{PROGRESS_KEY_SUFFIX}"


@dataclass(frozen=True)
class PeerProgress:
    """One peer's published progress (times are the publisher's DHT time)."""

    peer_id: str
    epoch: int
    samples: int
    samples_per_s: float
    time: float
    address: str | None
    client_mode: bool


def parse_record(subkey: object, value: object, max_samples_per_s: float) -> PeerProgress | None:
    """A peer's record from the DHT, or None if it is malformed."""
    peer_id = subkey_owner(subkey) if isinstance(subkey, str) else None
    if peer_id is None or not isinstance(value, dict):
        return None
    try:
        epoch, samples = int(value["epoch"]), int(value["samples"])
        rate, stamp = float(value["samples_per_s"]), float(value["time"])
        address, client_mode = value.get("address"), bool(value.get("client_mode", False))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    if epoch < 0 or samples < 0 or not math.isfinite(rate) or not math.isfinite(stamp):
        return None
    if address is not None and not isinstance(address, str):
        return None
    rate = min(max(rate, 0.0), max_samples_per_s)
    return PeerProgress(peer_id, epoch, samples, rate, stamp, address, client_mode)
