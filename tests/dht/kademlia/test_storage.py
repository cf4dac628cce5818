"""Local record storage: conflict rules, expiration, dictionaries, and the read cache."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.errors import ConfigError
from dht.kademlia import storage as storage_module
from dht.kademlia.storage import (
    ANONYMOUS,
    RECORD_OVERHEAD_BYTES,
    DHTStorage,
    Record,
    charges,
    merge_entries,
)
from dht.kademlia.value_cache import ValueCache
from dht.net.wire import pack

pytestmark = pytest.mark.timeout(30)

NOW = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = NOW):
        self.now = now

    def time(self) -> float:
        return self.now


def rec(value, expiration: float) -> Record:
    return Record(pack(value), expiration)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def storage(clock) -> DHTStorage:
    return DHTStorage(clock, max_records=1000)


def test_plain_newer_expiration_wins_older_never_overwrites(storage):
    assert storage.store(1, rec("a", NOW + 10))
    assert storage.store(1, rec("b", NOW + 20))
    assert not storage.store(1, rec("c", NOW + 15))
    assert storage.get(1) == rec("b", NOW + 20)
    assert storage.store(1, rec("b", NOW + 20)), "the same record again is an accepted no-op"
    assert len(storage) == 1


def test_equal_expirations_converge_whatever_the_order(clock):
    records = [rec("x", NOW + 5), rec("yy", NOW + 5), rec("z", NOW + 5)]
    expected = max(records, key=lambda r: r.value_bytes)
    for order in itertools.permutations(records):
        storage = DHTStorage(clock, max_records=10)
        for record in order:
            storage.store(7, record)
        assert storage.get(7) == expected


def test_past_expiration_is_refused(storage):
    assert not storage.store(1, rec("late", NOW))
    assert not storage.store(1, rec("late", NOW - 1), subkey="s")
    assert storage.get(1) is None


def test_expired_values_vanish_and_are_purged(storage, clock):
    storage.store(1, rec("short", NOW + 10))
    storage.store(2, rec("long", NOW + 100))
    storage.store(3, rec("a", NOW + 10), subkey="a")
    storage.store(3, rec("b", NOW + 100), subkey="b")
    assert len(storage) == 4
    clock.now = NOW + 10
    assert storage.get(1) is None
    assert storage.get(3) == {"b": rec("b", NOW + 100)}
    assert storage.purge_expired() == 2
    assert len(storage) == 2 and sorted(storage.keys()) == [2, 3]
    clock.now = NOW + 100
    assert storage.purge_expired() == 2
    assert len(storage) == 0 and storage.keys() == []


def test_subkeys_from_different_writers_merge(storage):
    assert storage.store(5, rec(1, NOW + 10), subkey="alice")
    assert storage.store(5, rec(2, NOW + 20), subkey="bob")
    assert storage.store(5, rec(3, NOW + 30), subkey=b"raw")
    assert not storage.store(5, rec(9, NOW + 5), subkey="alice")
    assert storage.store(5, rec(4, NOW + 40), subkey="alice")
    assert storage.get(5) == {
        "alice": rec(4, NOW + 40),
        "bob": rec(2, NOW + 20),
        b"raw": rec(3, NOW + 30),
    }
    assert len(storage) == 3


def test_plain_and_dictionary_newer_expiration_wins(storage):
    storage.store(1, rec("plain", NOW + 10))
    assert not storage.store(1, rec("sub", NOW + 10), subkey="s"), "a tie keeps what is there"
    assert storage.store(1, rec("sub", NOW + 20), subkey="s")
    assert storage.get(1) == {"s": rec("sub", NOW + 20)}
    storage.store(1, rec("sub2", NOW + 30), subkey="t")
    # A dictionary's expiration is that of its newest subkey.
    assert not storage.store(1, rec("plain", NOW + 25))
    assert storage.store(1, rec("plain", NOW + 31))
    assert storage.get(1) == rec("plain", NOW + 31)
    assert len(storage) == 1


def test_max_records_refuses_new_records_but_not_updates(clock):
    storage = DHTStorage(clock, max_records=2)
    assert storage.store(1, rec("a", NOW + 10))
    assert storage.store(2, rec("a", NOW + 10), subkey="x")
    assert not storage.store(3, rec("a", NOW + 10))
    assert not storage.store(2, rec("a", NOW + 10), subkey="y")
    assert storage.store(1, rec("b", NOW + 20))
    assert storage.store(2, rec("b", NOW + 20), subkey="x")
    with pytest.raises(ConfigError, match="max_records"):
        DHTStorage(clock, max_records=0)


def test_merge_entries_follows_the_store_rules():
    a = {"x": rec(1, NOW + 10), "y": rec(2, NOW + 50)}
    b = {"x": rec(3, NOW + 20), "z": rec(4, NOW + 5)}
    assert merge_entries(a, b) == {"x": rec(3, NOW + 20), "y": rec(2, NOW + 50), "z": b["z"]}
    assert merge_entries(a, b) == merge_entries(b, a)
    assert merge_entries(rec(1, NOW + 60), a) == rec(1, NOW + 60)
    assert merge_entries(a, rec(1, NOW + 40)) == a
    assert merge_entries(None, a) == a and merge_entries(a, None) == a
    assert merge_entries(rec(1, NOW + 1), rec(2, NOW + 2)) == rec(2, NOW + 2)


def test_updated_at_tracks_stores_including_the_same_record_again(storage):
    assert storage.updated_at_s(1) == float("-inf")
    storage.store(1, rec("a", NOW + 10))
    first = storage.updated_at_s(1)
    storage.store(1, rec("a", NOW + 10))
    assert storage.updated_at_s(1) >= first > float("-inf")


def test_cache_is_bounded_ages_out_and_hides_expired():
    monotonic_s = [0.0]
    cache = ValueCache(max_entries=2, max_age_s=10.0, monotonic=lambda: monotonic_s[0])
    cache.put(1, rec("a", NOW + 100))
    cache.put(2, rec("b", NOW + 100))
    assert cache.get(1, NOW) == rec("a", NOW + 100)  # 1 is now the most recently read
    cache.put(3, rec("c", NOW + 100))
    assert cache.get(2, NOW) is None and len(cache) == 2
    assert cache.get(3, NOW + 100) is None, "expired entries are not served"
    monotonic_s[0] = 10.5
    assert cache.get(1, NOW) is None, "older than max_age_s"
    cache.put(4, {"s": rec("x", NOW + 1), "t": rec("y", NOW + 100)})
    assert cache.get(4, NOW + 50) == {"t": rec("y", NOW + 100)}
    cache.invalidate(4)
    assert cache.get(4, NOW) is None
    disabled = ValueCache(max_entries=0, max_age_s=10.0)
    disabled.put(1, rec("a", NOW + 100))
    assert disabled.get(1, NOW) is None


def test_a_plain_value_never_wipes_signed_subkeys(storage):
    signed = Record(pack("mine"), NOW + 100, signature=b"s" * 64)
    assert storage.store(7, signed, "peer:" + "ab" * 32)
    assert not storage.store(7, rec("squatter", NOW + 5000))  # later expiration, still refused
    assert storage.get(7) == {"peer:" + "ab" * 32: signed}
    # replicas that disagree merge to the signed records too, whatever the order
    squatter = rec("squatter", NOW + 5000)
    assert merge_entries({"peer:" + "ab" * 32: signed}, squatter) == {"peer:" + "ab" * 32: signed}
    assert merge_entries(squatter, {"peer:" + "ab" * 32: signed}) == {"peer:" + "ab" * 32: signed}


def test_expirations_too_far_ahead_are_refused(clock):
    storage = DHTStorage(clock, max_records=10, max_expiration_ahead_s=3600)
    assert not storage.store(1, rec("squat", NOW + 3601))
    assert storage.store(1, rec("fine", NOW + 3600))
    assert not storage.store(2, rec("squat", NOW + 10**9), "peer:" + "cd" * 32)


OWNER_A, OWNER_B = "peer:" + "ab" * 32, "peer:" + "cd" * 32


def signed_rec(size: int, expiration: float) -> Record:
    return Record(b"v" * size, expiration, signature=b"s" * 64)


def test_a_plain_value_never_blocks_signed_subkeys(storage):
    # A stranger squats a predictable key (a future round's matchmaking key) for days...
    assert storage.store(9, rec("squatter", NOW + 5 * 24 * 3600))
    # ...and the first signed record there still goes in, whatever the expirations.
    assert storage.store(9, signed_rec(10, NOW + 30), OWNER_A)
    assert storage.get(9) == {OWNER_A: signed_rec(10, NOW + 30)}
    assert storage.owner_bytes(ANONYMOUS) == 0  # the squatter's bytes were given back
    # A subkey that names no owner is still subject to the expiration rule.
    assert storage.store(10, rec("squatter", NOW + 500))
    assert not storage.store(10, rec("other", NOW + 30), "free-for-all")


def test_bytes_are_capped_per_key_per_owner_and_in_all(clock):
    cost = 1000 + len(OWNER_A) + RECORD_OVERHEAD_BYTES  # one signed record of 1000 bytes
    storage = DHTStorage(
        clock, max_records=1000, max_bytes=5 * cost, max_bytes_per_key=2 * cost,
        max_bytes_per_owner=3 * cost,
    )  # fmt: skip
    owners = ["peer:" + f"{i:02x}" * 32 for i in range(8)]
    # per key: two owners fit under key 1, a third does not
    assert storage.store(1, signed_rec(1000, NOW + 10), owners[0])
    assert storage.store(1, signed_rec(1000, NOW + 10), owners[1])
    assert not storage.store(1, signed_rec(1000, NOW + 10), owners[2])
    # an owner may replace its own record under a full key (same size or smaller)
    assert storage.store(1, signed_rec(900, NOW + 20), owners[0])
    # per owner: owners[2] writes three keys, not a fourth
    for key in (2, 3, 4):
        assert storage.store(key, signed_rec(1000, NOW + 10), owners[2])
    assert not storage.store(5, signed_rec(1000, NOW + 10), owners[2])
    # in all: five records' worth are held; nobody gets a sixth
    assert storage.num_bytes <= 5 * cost
    assert not storage.store(6, signed_rec(1000, NOW + 10), owners[3])
    clock.now = NOW + 15  # expirations give the bytes back
    assert storage.store(6, signed_rec(1000, NOW + 100), owners[3])
    held = [storage.owner_bytes(o.removeprefix("peer:")) for o in owners]
    assert storage.num_bytes == sum(held) + storage.owner_bytes(ANONYMOUS) > 0


def test_unowned_records_cannot_crowd_out_owned_ones(clock):
    storage = DHTStorage(
        clock, max_records=10_000, max_bytes_per_key=20_000, max_unowned_bytes_per_key=4000,
        max_unowned_bytes=10_000,
    )  # fmt: skip
    stored = sum(storage.store(1, rec("x" * 900, NOW + 100), f"s{i}") for i in range(100))
    assert 0 < stored < 5  # the unowned share of the key is spent...
    assert storage.store(1, signed_rec(5000, NOW + 100), OWNER_A)  # ...owners keep the rest
    assert storage.store(1, signed_rec(5000, NOW + 100), OWNER_B)
    # and unowned records over all keys stay under their own cap
    for key in range(2, 50):
        storage.store(key, rec("y" * 900, NOW + 100))
    assert storage.owner_bytes(ANONYMOUS) <= 10_000


def recount(storage: DHTStorage) -> tuple[int, dict[str, int], int]:
    """Bytes, bytes by owner and records of what ``storage`` holds, counted from scratch."""
    by_owner: dict[str, int] = {}
    num_records = 0
    for key_id in storage.keys():
        entry = storage._data[key_id]
        num_records += 1 if isinstance(entry, Record) else len(entry)
        for owner, num_bytes in charges(entry).items():
            by_owner[owner] = by_owner.get(owner, 0) + num_bytes
    return sum(by_owner.values()), by_owner, num_records


STORES = st.lists(
    st.tuples(
        st.integers(0, 2),  # key
        st.sampled_from([None, "free-a", "free-b", OWNER_A, OWNER_B]),  # subkey
        st.integers(1, 400),  # value bytes
        st.integers(1, 60),  # seconds to expiration
        st.integers(0, 20),  # seconds the clock moves first
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(stores=STORES)
def test_the_counts_kept_per_store_equal_a_recount_of_what_is_held(stores):
    """Bytes are charged by the difference one store makes (a subkey's record alone, not the
    whole key); after any sequence of stores, replacements, refusals and expirations the
    counts equal a count from scratch, so no cap drifts."""
    clock = FakeClock()
    storage = DHTStorage(
        clock, max_records=12, max_bytes=4000, max_bytes_per_key=2000, max_bytes_per_owner=1500,
        max_unowned_bytes_per_key=900, max_unowned_bytes=1800,
    )  # fmt: skip
    for key_id, subkey, size, ttl_s, wait_s in stores:
        clock.now += wait_s
        record = signed_rec(size, clock.now + ttl_s) if subkey in (OWNER_A, OWNER_B) else None
        storage.store(key_id, record or rec("x" * size, clock.now + ttl_s), subkey)
        num_bytes, by_owner, num_records = recount(storage)
        assert storage.num_bytes == num_bytes and len(storage) == num_records
        for owner in by_owner.keys() | {ANONYMOUS, OWNER_A.removeprefix("peer:")}:
            assert storage.owner_bytes(owner) == by_owner.get(owner, 0), owner
        assert num_bytes <= 4000 and num_records <= 12
        assert all(sum(charges(storage._data[k]).values()) <= 2000 for k in storage.keys())


def test_a_store_under_a_key_of_thousands_prices_one_record(clock, monkeypatch):
    """Pricing a store is not a walk over the key: one more record under a key of 3000 costs
    the caps' check the same as under a key of one (a full key's walk took ~8 ms a store)."""
    storage = DHTStorage(clock, max_records=10_000, max_bytes_per_key=2**22)
    owners = ["peer:" + f"{i:064x}" for i in range(3001)]
    for owner in owners[:3000]:
        assert storage.store(1, signed_rec(100, NOW + 100), owner)
    priced = []
    monkeypatch.setattr(storage_module, "record_cost", lambda *a: priced.append(a) or 1)
    assert storage.store(1, signed_rec(100, NOW + 100), owners[3000])
    assert storage.store(1, signed_rec(50, NOW + 200), owners[0])  # a replacement
    assert len(priced) <= 3, len(priced)
