"""DHT ids and the k-bucket routing table."""

from __future__ import annotations

import hashlib
import random

import pytest

from dht.errors import ConfigError
from dht.identity import PeerIdentity
from dht.kademlia.routing import DHTID, MAX_ID, PeerInfo, RoutingTable

pytestmark = pytest.mark.timeout(30)


def _peer(rng: random.Random, address: str | None = None) -> PeerInfo:
    peer_id = rng.randbytes(32).hex()
    return PeerInfo.of(peer_id, address or f"mem://{peer_id[:6]}")


def _peer_in_range(rng: random.Random, lower: int, upper: int) -> PeerInfo:
    while True:
        peer = _peer(rng)
        if lower <= peer.node_id < upper:
            return peer


def test_ids_are_sha1_of_raw_public_key_and_of_key_bytes():
    identity = PeerIdentity.generate()
    expected = int.from_bytes(hashlib.sha1(bytes.fromhex(identity.peer_id)).digest(), "big")
    assert DHTID.from_peer_id(identity.peer_id) == expected
    assert DHTID.from_key("progress") == int(hashlib.sha1(b"progress").hexdigest(), 16)
    assert DHTID.from_key("ключ") == DHTID.from_key("ключ".encode())
    assert DHTID.from_key(b"\x00\xff") == int(hashlib.sha1(b"\x00\xff").hexdigest(), 16)
    with pytest.raises(TypeError):
        DHTID.from_key(5)  # type: ignore[arg-type]


def test_id_raw_form_round_trips_and_xor_distance():
    rng = random.Random(1)
    for _ in range(100):
        a = DHTID(rng.randrange(MAX_ID))
        b = DHTID(rng.randrange(MAX_ID))
        assert DHTID.from_raw(a.to_raw()) == a
        assert len(a.to_raw()) == 20
        assert a.xor_distance(b) == b.xor_distance(a) == int(a) ^ int(b)
        assert a.xor_distance(a) == 0
    with pytest.raises(ValueError):
        DHTID.from_raw(b"short")
    for _ in range(100):
        assert 1000 <= DHTID.random(1000, 1010) < 1010


def test_nearest_matches_brute_force_over_known_nodes():
    rng = random.Random(2)
    table = RoutingTable(DHTID(rng.randrange(MAX_ID)), bucket_size=20)
    for _ in range(2000):
        table.add_or_update(_peer(rng))
    known = table.peers()
    assert len(known) == len(table) > 100
    for _ in range(20):
        target = rng.randrange(MAX_ID)
        expected = sorted(known, key=lambda p: int(p.node_id) ^ target)[:20]
        assert table.nearest(target, 20) == expected
    excluded = known[0].node_id
    assert all(p.node_id != excluded for p in table.nearest(excluded, 20, exclude=excluded))


def test_buckets_partition_the_id_space_and_hold_at_most_k():
    rng = random.Random(3)
    own = DHTID(rng.randrange(MAX_ID))
    table = RoutingTable(own, bucket_size=8)
    for _ in range(3000):
        table.add_or_update(_peer(rng))
    assert table.buckets[0].lower == 0 and table.buckets[-1].upper == MAX_ID
    for left, right in zip(table.buckets, table.buckets[1:], strict=False):
        assert left.upper == right.lower
    num_nodes = 0
    for bucket in table.buckets:
        assert len(bucket.nodes) <= 8 and len(bucket.replacements) <= 8
        assert all(bucket.covers(node_id) for node_id in bucket.nodes)
        assert all(bucket.covers(node_id) for node_id in bucket.replacements)
        num_nodes += len(bucket.nodes)
    assert num_nodes == len(table)
    # The bucket holding the own id splits, so the table is deep around it.
    assert table.bucket_of(own).upper - table.bucket_of(own).lower < MAX_ID >> 6


def test_own_id_is_never_added():
    identity = PeerIdentity.generate()
    table = RoutingTable(DHTID.from_peer_id(identity.peer_id), bucket_size=4)
    assert table.add_or_update(PeerInfo.of(identity.peer_id, "mem://self")) is None
    assert len(table) == 0


def _full_far_bucket(rng: random.Random, k: int) -> tuple[RoutingTable, list[PeerInfo]]:
    """A table whose own id is in the lower half and whose upper-half bucket is full."""
    table = RoutingTable(DHTID(1), bucket_size=k)
    far = [_peer_in_range(rng, MAX_ID // 2, MAX_ID) for _ in range(k)]
    for peer in far:
        assert table.add_or_update(peer) is None
    return table, far


def test_full_bucket_names_oldest_for_a_ping_and_keeps_newcomer_as_replacement():
    rng = random.Random(4)
    table, far = _full_far_bucket(rng, k=3)
    newcomer = _peer_in_range(rng, MAX_ID // 2, MAX_ID)
    assert table.add_or_update(newcomer) == far[0]
    assert newcomer.node_id not in table
    bucket = table.bucket_of(newcomer.node_id)
    assert newcomer.node_id in bucket.replacements

    # The oldest answered: it moves to the back; the next newcomer pings the next oldest.
    table.mark_alive(far[0].node_id)
    assert list(bucket.nodes) == [far[1].node_id, far[2].node_id, far[0].node_id]
    assert table.add_or_update(_peer_in_range(rng, MAX_ID // 2, MAX_ID)) == far[1]


def test_remove_promotes_the_freshest_replacement():
    rng = random.Random(5)
    table, far = _full_far_bucket(rng, k=3)
    first, second = (_peer_in_range(rng, MAX_ID // 2, MAX_ID) for _ in range(2))
    table.add_or_update(first)
    table.add_or_update(second)
    assert table.remove(far[0].node_id)
    assert far[0].node_id not in table
    assert second.node_id in table and first.node_id not in table
    assert not table.remove(far[0].node_id)


def test_seen_node_moves_to_back_and_address_updates():
    rng = random.Random(6)
    table, far = _full_far_bucket(rng, k=3)
    moved = PeerInfo.of(far[0].peer_id, "mem://new-address")
    assert table.add_or_update(moved) is None
    bucket = table.bucket_of(moved.node_id)
    assert list(bucket.nodes)[-1] == moved.node_id
    assert table.get(moved.node_id).address == "mem://new-address"


def test_recently_seen_oldest_is_presumed_alive():
    rng = random.Random(7)
    table = RoutingTable(DHTID(1), bucket_size=2, liveness_check_after_s=3600.0)
    for _ in range(2):
        table.add_or_update(_peer_in_range(rng, MAX_ID // 2, MAX_ID))
    assert table.add_or_update(_peer_in_range(rng, MAX_ID // 2, MAX_ID)) is None
    assert len(table) == 2


def test_stale_buckets():
    table = RoutingTable(DHTID(1), bucket_size=2)
    assert table.stale_buckets(3600.0) == []
    assert table.stale_buckets(0.0) == table.buckets


def test_bucket_size_validated():
    with pytest.raises(ConfigError, match="bucket_size"):
        RoutingTable(DHTID(1), bucket_size=0)
