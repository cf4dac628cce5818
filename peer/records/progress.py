"""The progress record (``{run_id}/progress``): one peer's epoch, samples and rate, and its parser.

Wire format (a msgpack map under the publisher's owner subkey; unknown fields are ignored):
``epoch`` int in [0, 2**53), ``samples`` int in [0, 2**53), ``samples_per_s`` finite float in
[0, 1e12], ``time`` the publisher's DHT time (finite, in [0, 1e11]), ``address`` an
``http(s)://host:port`` URL or None, ``client_mode`` bool. A record that does not fit is dropped
and counted (:mod:`peer.records.schema`). Torch-free, like everything in :mod:`peer.records`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

from peer.records.schema import (
    Count,
    PeerUrl,
    Rate,
    Seconds,
    WireModel,
    check_multiaddr,
    owner_of,
    parse_value,
)

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


class ProgressWire(WireModel):
    """The progress record's value as it travels (see the module docstring)."""

    epoch: Count
    samples: Count
    samples_per_s: Rate
    time: Seconds
    address: PeerUrl | None = None
    client_mode: bool = False


class HivemindProgressWire(ProgressWire):
    """The same record published by the hivemind backend: its address is a multiaddr."""

    address: Annotated[str, AfterValidator(check_multiaddr)] | None = None  # type: ignore[assignment]


def parse_record(
    subkey: object, value: object, max_samples_per_s: float, *, multiaddr: bool = False
) -> PeerProgress | None:
    """A peer's record from the DHT, or None (counted) if it does not fit the schema.

    The rate is clamped to ``max_samples_per_s``, the reader's largest believable rate.
    ``multiaddr`` reads the hivemind backend's records (libp2p addresses).
    """
    peer_id = owner_of(subkey)
    model = HivemindProgressWire if multiaddr else ProgressWire
    wire = parse_value(model, "progress", peer_id, value)
    if wire is None or peer_id is None:
        return None
    rate = min(wire.samples_per_s, max_samples_per_s)
    return PeerProgress(
        peer_id, wire.epoch, wire.samples, rate, wire.time, wire.address, wire.client_mode
    )
