"""What a downloader reads before it trusts a state: the donors' announcements, and the digests
enough of them agree on (:mod:`peer.records.state`).

In a small swarm a read covers every announcement; in a large one those of this peer's bucket,
its anchors' (donors it was told to use, partners) and a few drawn at random
(:func:`peer.records.buckets.sample_bucket_keys`): at most four keys a bucket, whatever the
swarm's size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dht.kademlia.node import DHTNode
from peer.records.buckets import read_buckets, sample_bucket_keys
from peer.records.state import (
    STATE_RECORDS_PER_BUCKET,
    StateAnnouncement,
    agreed_digests,
    parse_state,
    state_key,
)
from peer.swarm.state_sync_config import StateSyncConfig

# Reads of the announcements (0.5, 1 and 2 s apart) before a state's digest counts as unagreed,
# or before a downloader stops waiting for the newest state to be agreed.
AGREEMENT_READS = 3

# Buckets drawn at random on top of this peer's and its anchors' (a read of the announcements
# costs at most four keys a bucket, whatever the swarm's size)
RANDOM_BUCKETS = 2


@dataclass(frozen=True)
class Reach:
    """Which announcements a read covers: the swarm's size as the reader counts it (the layout
    in use) and the peers whose buckets it must read (donors it was told to use, partners)."""

    num_peers: float = 1.0
    anchors: frozenset[str] = frozenset()


async def read_announcements(
    dht: DHTNode, prefix: str, reach: Reach = Reach(), rng: random.Random | None = None
) -> list[StateAnnouncement]:
    """The other peers' well-formed announcements (malformed ones are dropped and counted): in
    a small swarm every one; in a large one those of this peer's bucket, its anchors' and a few
    drawn at random (:func:`peer.records.buckets.sample_bucket_keys`)."""
    keys = sample_bucket_keys(
        state_key(prefix),
        num_peers=reach.num_peers,
        records_per_bucket=STATE_RECORDS_PER_BUCKET,
        anchors=[dht.peer_id, *sorted(reach.anchors)],
        num_random=RANDOM_BUCKETS,
        rng=rng or random.Random(),
    )
    found = await read_buckets(dht, keys, parse=parse_state, newest_by=lambda a: a.epoch)
    return [a for a in found if a.peer_id != dht.peer_id]


@dataclass(frozen=True)
class Agreement:
    """The digests enough peers announce: ``(epoch, digest)`` -> number of peers; and past the
    newest of them, the digests this peer's partners announce (``vouched``, same form)."""

    announcements: list[StateAnnouncement]
    agreed: dict[tuple[int, str], int]
    required: int
    vouched: dict[tuple[int, str], int] = field(default_factory=dict)

    def accepts(self, epoch: int, digest: str) -> bool:
        return (epoch, digest) in self.agreed or (epoch, digest) in self.vouched

    @property
    def newest_epoch(self) -> int:
        """The newest epoch with an agreed digest (-1: none)."""
        return max((epoch for epoch, _ in self.agreed), default=-1)


def partner_vouched(
    announcements: list[StateAnnouncement],
    agreed: dict[tuple[int, str], int],
    partners: frozenset[str],
    *,
    bf16: bool,
) -> dict[tuple[int, str], int]:
    """The digests ``partners`` announce for epochs past the newest agreed one.

    Replicas that all differ (every peer of a small swarm stepped alone in one epoch, each on
    its own gradient) never agree again by themselves: no digest of theirs has two voters, so
    without a partner's word none of them could take another's state, and each would train
    apart for good. A partner (averaged with this peer in its last rounds) has the trust the
    re-sync rule already gives it (:func:`peer.records.state.resync_target`); where a quorum
    speaks for an epoch or a later one, the quorum alone counts.
    """
    newest = max((epoch for epoch, _ in agreed), default=-1)
    theirs = [a for a in announcements if a.peer_id in partners]
    votes = agreed_digests(theirs, min_peers=1, bf16=bf16)
    return {pair: count for pair, count in votes.items() if pair[0] > newest}


async def read_agreement(
    dht: DHTNode,
    prefix: str,
    config: StateSyncConfig,
    reach: Reach = Reach(),
    partners: frozenset[str] = frozenset(),
) -> Agreement:
    """The announcements and the digests ``config.min_agreement`` of them agree on (fewer when
    fewer peers announce at all), and past those the digests ``partners`` announce."""
    announcements = await read_announcements(dht, prefix, reach)
    required = max(1, min(config.min_agreement, len(announcements)))
    bf16 = config.compression == "bf16"
    agreed = agreed_digests(announcements, min_peers=required, bf16=bf16)
    vouched = partner_vouched(announcements, agreed, partners, bf16=bf16)
    return Agreement(announcements, agreed, required, vouched)
