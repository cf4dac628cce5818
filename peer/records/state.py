"""The state announcement (``{run_id}/state/{level}/{bucket}``): which peer serves its state,
of which epoch, and the digests of its state at its last epochs; and the rules that read digests
as agreement.

Format version 3 (a msgpack map under the peer's owner subkey; unknown fields are ignored):
``v`` = 3; ``epoch`` (int in [0, 2**53)) the epoch of the state it serves now; ``address`` its
``http(s)://host:port`` (None: it serves nothing, client mode, but its digests still count);
``digests`` a list of at most 16 maps ``{epoch, digest, digest_bf16}``, newest last: the hex
BLAKE3 digest of its state at the start of each of its last epochs (:mod:`peer.swarm.state_digest`),
and the same of that state rounded to bfloat16 as a ``bf16`` download delivers it (or None).
A peer announces right after each round (at most every half second) and every few seconds.
Version 1 (``{epoch, address}``, no digest) is dropped: its state cannot be checked; so is
version 2 (the same fields, SHA-256 digests), whose digests no peer of version 3 computes:
peers of the two versions neither count nor download each other's states.

A downloader accepts a state only if its digest is one that enough distinct peers announce for
that epoch (:func:`agreed_digests`); the dashboard marks a peer whose newest digest differs from
the one most peers at that epoch announce (:func:`replica_outliers`); a peer whose own digest
loses to another one (:func:`resync_target`) downloads that state. Announcements live in buckets
of about ``STATE_RECORDS_PER_BUCKET`` (:mod:`peer.records.buckets`): a peer reads its own
bucket, its partners' and a few drawn at random, whatever the swarm's size. Torch-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from peer.records.buckets import record_key
from peer.records.schema import Count, PeerUrl, WireModel, owner_of, parse_value

STATE_KEY_SUFFIX = "state"
STATE_RECORD_VERSION = 3
MAX_DIGESTS = 16
# Announcements a bucket holds, about (some 2 KB each: some 64 KB a key).
STATE_RECORDS_PER_BUCKET = 32
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def state_key(run_id: str) -> str:
    """The prefix of a run's state announcement keys (:func:`announcement_key`)."""
    return f"{run_id}/{STATE_KEY_SUFFIX}"


def announcement_key(run_id: str, peer_id: str, num_peers: float = 1.0) -> str:
    """Where ``peer_id`` announces when it counts ``num_peers`` peers in the swarm."""
    return record_key(state_key(run_id), peer_id, num_peers, STATE_RECORDS_PER_BUCKET)


@dataclass(frozen=True)
class EpochDigest:
    """A peer's state at the start of ``epoch`` has ``digest`` (``digest_bf16``: rounded to
    bfloat16; None when not computed)."""

    epoch: int
    digest: str
    digest_bf16: str | None = None


@dataclass(frozen=True)
class StateAnnouncement:
    """One peer's announcement: it serves its state of ``epoch`` at ``address`` (None: it
    serves nothing) and its state had ``digests`` at its last epochs (newest last)."""

    peer_id: str
    epoch: int
    address: str | None
    digests: tuple[EpochDigest, ...] = ()

    @property
    def latest(self) -> EpochDigest | None:
        return self.digests[-1] if self.digests else None

    def to_wire(self) -> dict:
        """The value stored on the DHT (the subkey names the peer)."""
        return {
            "v": STATE_RECORD_VERSION,
            "epoch": self.epoch,
            "address": self.address,
            "digests": [
                {"epoch": d.epoch, "digest": d.digest, "digest_bf16": d.digest_bf16}
                for d in self.digests
            ],
        }


class _DigestWire(WireModel):
    epoch: Count
    digest: Digest
    digest_bf16: Digest | None = None


class StateWire(WireModel):
    """The announcement's value as it travels (see the module docstring)."""

    v: Literal[3]
    epoch: Count
    address: PeerUrl | None = None
    digests: list[_DigestWire] = Field(default_factory=list, max_length=MAX_DIGESTS)


def parse_state(subkey: object, value: object) -> StateAnnouncement | None:
    """A peer's announcement from the DHT, or None (counted) if it does not fit the schema."""
    peer_id = owner_of(subkey)
    wire = parse_value(StateWire, "state", peer_id, value)
    if wire is None or peer_id is None:
        return None
    digests = tuple(EpochDigest(d.epoch, d.digest, d.digest_bf16) for d in wire.digests)
    return StateAnnouncement(peer_id, wire.epoch, wire.address, digests)


def agreed_digests(
    announcements: Iterable[StateAnnouncement], *, min_peers: int, bf16: bool = False
) -> dict[tuple[int, str], int]:
    """``(epoch, digest)`` -> how many distinct peers announce it, for the pairs at least
    ``min_peers`` of them announce (``bf16``: the bfloat16 digests). A peer votes once per
    epoch (its newest digest of that epoch)."""
    votes: Counter[tuple[int, str]] = Counter()
    for announcement in {a.peer_id: a for a in announcements}.values():
        mine = {d.epoch: (d.digest_bf16 if bf16 else d.digest) for d in announcement.digests}
        votes.update((epoch, digest) for epoch, digest in mine.items() if digest is not None)
    return {pair: count for pair, count in votes.items() if count >= min_peers}


def replica_outliers(announcements: Iterable[StateAnnouncement]) -> set[str]:
    """Peers whose newest digest differs from the one most peers announce for that epoch (a
    replica that drifted, or a liar). An epoch that fewer than two peers announce alike, or
    where two digests tie for the most, says nothing."""
    by_peer = {a.peer_id: a for a in announcements}
    by_epoch: dict[int, Counter[str]] = {}
    for announcement in by_peer.values():
        for entry in announcement.digests:
            by_epoch.setdefault(entry.epoch, Counter())[entry.digest] += 1
    outliers = set()
    for announcement in by_peer.values():
        latest = announcement.latest
        if latest is None:
            continue
        ranked = by_epoch[latest.epoch].most_common(2)
        if ranked[0][1] < 2 or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
            continue
        if latest.digest != ranked[0][0]:
            outliers.add(announcement.peer_id)
    return outliers


@dataclass(frozen=True)
class ResyncTarget:
    """The state a peer's replica should be replaced by: ``digest`` at ``epoch``, which the
    peers ``donors`` announce."""

    epoch: int
    digest: str
    donors: frozenset[str]


def resync_target(
    announcements: Iterable[StateAnnouncement],
    *,
    own: EpochDigest,
    own_id: str,
    partners: frozenset[str] = frozenset(),
    min_peers: int = 2,
) -> ResyncTarget | None:
    """The digest that replaces this peer's ``own`` at its epoch, or None when its own stands.

    Each peer votes once for its newest digest of that epoch (this peer, ``own_id``, for
    ``own``; the ``announcements`` are the others'). Another digest can win only if at least
    ``min_peers`` peers announce it or one of them is a partner (a peer this one averaged with
    lately): a stranger alone never can. It wins with more votes than ``own``, or as many and
    the smallest peer id among its voters: a rule every peer applies alike, epoch after epoch,
    so that of two partners that disagree one by one, the same one yields every time.
    """
    voters: dict[str, set[str]] = {}
    for announcement in {a.peer_id: a for a in announcements}.values():
        if announcement.peer_id == own_id:
            continue
        digest = {d.epoch: d.digest for d in announcement.digests}.get(own.epoch)
        if digest is not None:
            voters.setdefault(digest, set()).add(announcement.peer_id)
    voters.setdefault(own.digest, set()).add(own_id)
    ranked = sorted(
        (-len(peers), min(peers), digest)
        for digest, peers in voters.items()
        if digest == own.digest or len(peers) >= min_peers or peers & partners
    )
    best = ranked[0][2]  # the most votes, then the smallest peer id
    if best == own.digest:
        return None
    return ResyncTarget(own.epoch, best, frozenset(voters[best]))
