"""The state announcement (``{run_id}/state``): which peer serves its state, of which epoch, and
the digest of that state; and the rules that read digests as agreement.

Format version 2 (a msgpack map under the donor's owner subkey; unknown fields are ignored):
``v`` = 2, ``epoch`` int in [0, 2**53), ``address`` the donor's ``http(s)://host:port``,
``digest`` the hex SHA-256 of its state at the start of that epoch
(:mod:`peer.swarm.state_digest`), ``digest_bf16`` the same over the state as a ``bf16``
download delivers it (or None). A peer announces right after each round and every few seconds.
Version 1 (``{epoch, address}``, no digest) is dropped: its state cannot be checked.

A downloader accepts a state only if its digest is one that at least two distinct peers at that
epoch announce (:func:`agreed_digests`); the dashboard marks a peer whose digest differs from the
one most peers at its epoch announce (:func:`replica_outliers`). Torch-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from peer.records.schema import Count, PeerUrl, WireModel, owner_of, parse_value

STATE_KEY_SUFFIX = "state"
STATE_RECORD_VERSION = 2
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def state_key(run_id: str) -> str:
    """The DHT key of a run's state announcements."""
    return f"{run_id}/{STATE_KEY_SUFFIX}"


@dataclass(frozen=True)
class StateAnnouncement:
    """One donor's announcement: its state of ``epoch`` has ``digest`` and is served at
    ``address`` (``digest_bf16``: of the same state rounded to bfloat16, or None)."""

    peer_id: str
    epoch: int
    address: str
    digest: str
    digest_bf16: str | None = None

    def to_wire(self) -> dict:
        """The value stored on the DHT (the subkey names the peer)."""
        return {
            "v": STATE_RECORD_VERSION,
            "epoch": self.epoch,
            "address": self.address,
            "digest": self.digest,
            "digest_bf16": self.digest_bf16,
        }


class StateWire(WireModel):
    """The announcement's value as it travels (see the module docstring)."""

    v: Literal[2]
    epoch: Count
    address: PeerUrl
    digest: Digest
    digest_bf16: Digest | None = None


def parse_state(subkey: object, value: object) -> StateAnnouncement | None:
    """A donor's announcement from the DHT, or None (counted) if it does not fit the schema."""
    peer_id = owner_of(subkey)
    wire = parse_value(StateWire, "state", peer_id, value)
    if wire is None or peer_id is None:
        return None
    return StateAnnouncement(peer_id, wire.epoch, wire.address, wire.digest, wire.digest_bf16)


def agreed_digests(
    announcements: Iterable[StateAnnouncement], *, min_peers: int, bf16: bool = False
) -> dict[tuple[int, str], int]:
    """``(epoch, digest)`` -> how many distinct peers announce it, for the pairs at least
    ``min_peers`` of them announce (``bf16``: the bfloat16 digests)."""
    by_peer = {a.peer_id: a for a in announcements}  # one vote per peer
    votes = Counter(
        (a.epoch, a.digest_bf16 if bf16 else a.digest)
        for a in by_peer.values()
        if (a.digest_bf16 if bf16 else a.digest) is not None
    )
    return {pair: count for pair, count in votes.items() if count >= min_peers}


def replica_outliers(announcements: Iterable[StateAnnouncement]) -> set[str]:
    """Peers whose digest differs from the one most peers at their epoch announce (a replica
    that drifted, or a liar). An epoch without a digest announced by two peers or more, or with
    a tie for the most, says nothing."""
    by_epoch: dict[int, list[StateAnnouncement]] = {}
    for announcement in {a.peer_id: a for a in announcements}.values():
        by_epoch.setdefault(announcement.epoch, []).append(announcement)
    outliers: set[str] = set()
    for group in by_epoch.values():
        ranked = Counter(a.digest for a in group).most_common(2)
        if ranked[0][1] < 2 or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
            continue
        outliers.update(a.peer_id for a in group if a.digest != ranked[0][0])
    return outliers
