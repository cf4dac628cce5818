"""DHTNode behaviour over the in-memory transport: replication, expiration, dictionaries,
validation, client mode, failures and the cache (its upkeep is in test_node_upkeep.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dht.config import DHTConfig
from dht.errors import (
    BadMessageError,
    RemoteError,
)
from dht.identity import PeerIdentity
from dht.kademlia.node import ValueWithExpiration, get_dht_time
from dht.kademlia.routing import DHTID
from dht.kademlia.storage import Record
from dht.kademlia.validation import owner_subkey, sign_record, signed_bytes
from dht.net.wire import pack

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


def holders(swarm, key) -> set[str]:
    key_id = DHTID.from_key(key)
    return {node.peer_id for node in swarm.nodes if node.storage.get(key_id) is not None}


def closest(swarm, key, count: int) -> set[str]:
    key_id = DHTID.from_key(key)
    ranked = sorted(swarm.nodes, key=lambda n: n.node_id ^ key_id)
    return {node.peer_id for node in ranked[:count]}


def farthest(swarm, key):
    """The node least likely to hold ``key``: no replica, not even a stray copy."""
    key_id = DHTID.from_key(key)
    return max(swarm.nodes, key=lambda n: n.node_id ^ key_id)


async def test_values_of_every_kind_are_found_from_every_node(memory_swarm):
    swarm = await memory_swarm(20)
    values = {
        "dict": {"epoch": 3, "peers": ["a", "b"], "nested": {"x": 1.5}},
        "list": [1, 2, [3, None, True]],
        "str": "héllo",
        b"bytes-key": b"\x00\x01\xff",
        "int": -(2**40),
        "float": 0.25,
    }
    expiration = get_dht_time() + 60
    for i, (key, value) in enumerate(values.items()):
        assert await swarm.nodes[i].store(key, value, expiration)
    for node in swarm.nodes:
        for key, value in values.items():
            found = await node.get(key)
            assert found == ValueWithExpiration(value, expiration), (node, key)
    missing = await swarm.nodes[0].get_outcome("never stored")
    assert missing.value is None and missing.reason == "not found" and missing.num_queried > 0


async def test_store_replicates_to_the_k_closest(memory_swarm):
    swarm = await memory_swarm(24, config=DHTConfig(bucket_size=5, rpc_timeout_s=2.0))
    for i in range(10):
        key = f"replicated-{i}"
        outcome = await swarm.nodes[i].store_outcome(key, i, get_dht_time() + 60)
        assert outcome.ok and outcome.num_accepted == outcome.num_targets == 5
        # Every one of the 5 closest holds it. A store sent to the best candidate known at the
        # time may leave a stray copy just beyond them when a closer node turns up meanwhile.
        assert closest(swarm, key, 5) <= holders(swarm, key) <= closest(swarm, key, 10)


async def test_single_node_stores_and_gets_locally(memory_swarm):
    swarm = await memory_swarm(1)
    node = swarm.nodes[0]
    assert await node.store("alone", [1], get_dht_time() + 60)
    outcome = await node.get_outcome("alone")
    assert outcome.source == "local" and outcome.value.value == [1]
    assert (await node.get("alone", latest=True)).value == [1]


async def test_dictionary_subkeys_from_writers_and_replicas_merge(memory_swarm):
    swarm = await memory_swarm(16)
    expiration = get_dht_time() + 60
    for i, writer in enumerate(swarm.nodes[:4]):
        assert await writer.store("dict", {"n": i}, expiration + i, subkey=f"w{i}")
    expected = {f"w{i}": ValueWithExpiration({"n": i}, expiration + i) for i in range(4)}
    for reader in swarm.nodes:
        found = await reader.get("dict")
        assert found == ValueWithExpiration(expected, expiration + 3)

    # Two replicas each hold a subkey the other lacks: a latest read merges both.
    key_id = DHTID.from_key("split")
    reader = swarm.nodes[-1]
    replicas = [n for n in swarm.nodes if n is not reader]
    replicas.sort(key=lambda n: n.node_id ^ key_id)
    replicas[0].storage.store(key_id, Record(pack("a"), expiration), "a")
    replicas[1].storage.store(key_id, Record(pack("b"), expiration), "b")
    found = await reader.get("split", latest=True)
    assert set(found.value) == {"a", "b"}
    assert found.value["b"] == ValueWithExpiration("b", expiration)


async def test_expired_values_disappear_everywhere(memory_swarm):
    clock = FakeClock()
    swarm = await memory_swarm(10, clock=clock)
    writer, reader = swarm.nodes[0], swarm.nodes[-1]
    assert await writer.store("short", "gone soon", clock.now + 10)
    assert await writer.store("long", "stays", clock.now + 100)
    assert (await reader.get("short")).value == "gone soon"  # now cached by the reader too
    clock.now += 11
    assert await reader.get("short") is None
    assert await reader.get("short", latest=True) is None
    assert (await reader.get("long")).value == "stays"
    for node in swarm.nodes:
        node.storage.purge_expired()
        assert node.storage.get(DHTID.from_key("short")) is None
    assert holders(swarm, "short") == set()
    assert await writer.store("short", "too late", clock.now - 1) is False


async def test_newer_expiration_wins_and_older_is_ignored(memory_swarm):
    swarm = await memory_swarm(12)
    now = get_dht_time()
    a, b, reader = swarm.nodes[0], swarm.nodes[5], swarm.nodes[11]
    assert await a.store("versioned", "v1", now + 100)
    assert not await b.store("versioned", "older", now + 50), "every replica refuses it"
    assert (await reader.get("versioned", latest=True)).value == "v1"
    assert await b.store("versioned", "v2", now + 200)
    assert await reader.get("versioned", latest=True) == ValueWithExpiration("v2", now + 200)

    # A plain value and a dictionary under one key: the newer expiration wins.
    assert await a.store("mixed", "plain", now + 100)
    assert not await b.store("mixed", "sub", now + 90, subkey="s")
    assert await b.store("mixed", "sub", now + 150, subkey="s")
    found = await reader.get("mixed", latest=True)
    assert found.value == {"s": ValueWithExpiration("sub", now + 150)}
    assert await a.store("mixed", "plain again", now + 300)
    assert (await reader.get("mixed", latest=True)).value == "plain again"


async def test_value_limits_are_enforced(memory_swarm):
    swarm = await memory_swarm(3, config=DHTConfig(max_value_bytes=100, rpc_timeout_s=2.0))
    node = swarm.nodes[0]
    with pytest.raises(BadMessageError, match="max_value_bytes"):
        await node.store("big", b"x" * 200, get_dht_time() + 60)
    with pytest.raises(BadMessageError, match="packed"):
        await node.store("odd", object(), get_dht_time() + 60)
    # A replica refuses an oversized value sent by a node configured differently.
    big = Record(b"\xc4\xc8" + b"x" * 200, get_dht_time() + 60)
    payload = {"addr": None, "records": [[DHTID.from_key("big").to_raw(), None,
                                          big.value_bytes, big.expiration_time, None]]}  # fmt: skip
    with pytest.raises(RemoteError) as refused:
        await swarm.nodes[1].transport.call(node.address, "dht.store", payload)
    assert refused.value.status == 400


def _store_payload(key: str, subkey, record: Record) -> dict:
    raw_key = DHTID.from_key(key).to_raw()
    return {
        "addr": None,
        "records": [[raw_key, subkey, record.value_bytes, record.expiration_time,
                     record.signature]],
    }  # fmt: skip


async def test_owner_subkeys_are_signed_and_only_the_owner_writes_them(memory_swarm):
    swarm = await memory_swarm(12)
    alice, mallory, reader = swarm.nodes[0], swarm.nodes[1], swarm.nodes[-1]
    subkey = owner_subkey(alice.peer_id)
    now = get_dht_time()
    assert await alice.store("progress", {"epoch": 1}, now + 100, subkey=subkey)
    found = await reader.get("progress", latest=True)
    assert found.value == {subkey: ValueWithExpiration({"epoch": 1}, now + 100)}

    # Through its own node, mallory cannot even try.
    assert not await mallory.store("progress", {"epoch": 99}, now + 500, subkey=subkey)
    # Sent raw, a forged record is refused by every replica with 422.
    value = pack({"epoch": 99})
    key_id = DHTID.from_key("progress")
    forged = Record(
        value, now + 500, mallory.identity.sign(signed_bytes(key_id, subkey, value, now + 500))
    )
    for replica in swarm.nodes:
        if replica is mallory:
            continue
        with pytest.raises(RemoteError) as refused:
            await mallory.transport.call(
                replica.address, "dht.store", _store_payload("progress", subkey, forged)
            )
        assert refused.value.status == 422
    # A genuine record of alice's, signed for another key, is refused as well.
    moved = sign_record(alice.identity, DHTID.from_key("other"), subkey, value, now + 500)
    with pytest.raises(RemoteError) as refused:
        await mallory.transport.call(
            reader.address, "dht.store", _store_payload("progress", subkey, moved)
        )
    assert refused.value.status == 422
    found = await reader.get("progress", latest=True)
    assert found.value[subkey].value == {"epoch": 1}


async def test_replayed_old_record_is_refused(memory_swarm):
    swarm = await memory_swarm(10)
    alice, mallory, reader = swarm.nodes[0], swarm.nodes[1], swarm.nodes[-1]
    subkey = owner_subkey(alice.peer_id)
    key_id = DHTID.from_key("state")
    now = get_dht_time()
    assert await alice.store("state", "epoch 1", now + 100, subkey=subkey)
    holder = next(n for n in swarm.nodes if n.storage.get(key_id))
    old = holder.storage.get(key_id)[subkey]
    assert await alice.store("state", "epoch 2", now + 200, subkey=subkey)
    newer = [n for n in swarm.nodes if (n.storage.get(key_id) or {}).get(subkey, old) != old]
    # every replica holds the newer one (10 nodes: all of them, with 20 replicas)
    assert len(newer) >= min(alice.config.num_replicas, len(swarm.nodes))
    for replica in newer:
        if replica is mallory:
            continue
        answer = await mallory.transport.call(
            replica.address, "dht.store", _store_payload("state", subkey, old)
        )
        assert answer["accepted"] == [False]
    found = await reader.get("state", latest=True)
    assert found.value[subkey] == ValueWithExpiration("epoch 2", now + 200)


async def test_reader_drops_records_that_fail_validation(memory_swarm):
    swarm = await memory_swarm(8)
    reader = swarm.nodes[0]
    victim = PeerIdentity.generate()
    subkey = owner_subkey(victim.peer_id)
    key_id = DHTID.from_key("poisoned")
    now = get_dht_time()
    # Replicas that skipped validation (compromised): they hold a forged record and a good one.
    for node in swarm.nodes[1:]:
        node.storage.store(key_id, Record(pack("forged"), now + 100, b"\x01" * 64), subkey)
        node.storage.store(key_id, Record(pack("free"), now + 100), "free")
    found = await reader.get("poisoned", latest=True)
    assert found.value == {"free": ValueWithExpiration("free", now + 100)}


async def test_a_fresh_read_skips_the_read_cache_and_latest_asks_the_replicas(memory_swarm):
    swarm = await memory_swarm(12, config=DHTConfig(num_replicas=5, rpc_timeout_s=2.0))
    writer = swarm.nodes[0]
    replicas = closest(swarm, "progress", writer.config.num_replicas)
    reader = next(n for n in swarm.nodes if n.peer_id not in replicas and n is not writer)
    now = get_dht_time()
    subkey = owner_subkey(writer.peer_id)
    assert await writer.store("progress", {"epoch": 1}, now + 60, subkey=subkey)
    assert (await reader.get("progress")).value[subkey].value == {"epoch": 1}  # now cached
    assert await writer.store("progress", {"epoch": 2}, now + 61, subkey=subkey)
    assert (await reader.get("progress")).value[subkey].value == {"epoch": 1}  # the cache
    assert (await reader.get("progress", fresh=True)).value[subkey].value == {"epoch": 2}
    assert (await reader.get("progress", latest=True)).value[subkey].value == {"epoch": 2}
    # the replicas, and no more, hold it: a latest read merges num_replicas copies, not k
    holding = holders(swarm, "progress")
    assert replicas <= holding and len(holding) <= writer.config.num_replicas + 1


async def test_a_latest_read_of_a_few_replicas_asks_about_that_many_and_merges_every_writer(
    memory_swarm,
):
    swarm = await memory_swarm(40)  # 20 replicas per key (the default) of 40 nodes
    expiration = get_dht_time() + 60
    writers = swarm.nodes[:12]
    for writer in writers:
        subkey = owner_subkey(writer.peer_id)
        assert await writer.store("bucket", {"epoch": 1}, expiration, subkey=subkey)
    reader = farthest(swarm, "bucket")
    every = await reader.get_outcome("bucket", latest=True)
    few = await reader.get_outcome("bucket", latest=True, replicas=4)
    expected = {owner_subkey(w.peer_id) for w in writers}
    assert set(every.value.value) == expected and set(few.value.value) == expected
    # each replica merged is a request: the closest 4 (and a node on the way), not all 20
    assert every.num_queried >= 20 and few.num_queried <= 6, (every, few)
    # more than num_replicas is num_replicas
    capped = await reader.get_outcome("bucket", latest=True, replicas=1000)
    assert capped.num_queried >= 20


async def test_a_store_to_a_few_replicas_reaches_the_closest_and_a_read_of_fewer_finds_it(
    memory_swarm,
):
    swarm = await memory_swarm(40)  # 20 replicas per key by default
    expiration = get_dht_time() + 60
    writers = swarm.nodes[:12]
    before = {w.peer_id: w.protocol.num_requests_sent for w in writers}
    for writer in writers:
        subkey = owner_subkey(writer.peer_id)
        assert await writer.store("bucket", {"epoch": 1}, expiration, subkey=subkey, replicas=6)
    # the 6 closest hold every writer's record (a writer among them keeps its own copy), and
    # no node beyond the 7 closest holds one (one stray at most, see dht.kademlia.lookup)
    six = closest(swarm, "bucket", 6)
    assert six <= holders(swarm, "bucket") <= closest(swarm, "bucket", 7)
    # each store asked the alpha closest it found, then stored on about 6: not 20
    sent = [w.protocol.num_requests_sent - before[w.peer_id] for w in writers]
    assert max(sent) <= 12, sent
    reader = farthest(swarm, "bucket")
    few = await reader.get_outcome("bucket", latest=True, replicas=4)
    assert set(few.value.value) == {owner_subkey(w.peer_id) for w in writers}


async def test_client_mode_node_stores_and_gets_through_others(memory_swarm):
    swarm = await memory_swarm(10)
    client = await swarm.add(client_mode=True)
    swarm.nodes.remove(client)  # keep the server nodes apart for the checks below
    try:
        assert client.address is None
        now = get_dht_time()
        assert await client.store("from-client", "hi", now + 60)
        num_replicas = client.config.num_replicas
        assert holders(swarm, "from-client") == closest(swarm, "from-client", num_replicas)
        assert (await swarm.nodes[3].get("from-client")).value == "hi"
        assert await swarm.nodes[3].store("to-client", "hello", now + 60)
        assert (await client.get("to-client")).value == "hello"
        assert client.num_known_peers > 0 and len(client.storage) == 0
        for node in swarm.nodes:
            assert client.node_id not in node.routing
    finally:
        await client.close()
        await client.transport.close()


async def test_dead_nodes_are_dropped_and_lookups_go_on(memory_swarm):
    swarm = await memory_swarm(24, config=DHTConfig(bucket_size=8, rpc_timeout_s=2.0))
    now = get_dht_time()
    for i in range(10):
        assert await swarm.nodes[i].store(f"churn-{i}", i, now + 60)
    reader = swarm.nodes[-1]
    for node in swarm.nodes[:8]:
        await swarm.kill(node)
    dead = {node.node_id for node in swarm.killed}
    num_dead_known = sum(node_id in reader.routing for node_id in dead)
    for i in range(10):
        assert (await reader.get(f"churn-{i}", latest=True)).value == i
    assert sum(node_id in reader.routing for node_id in dead) < max(1, num_dead_known)


async def test_network_failure_gives_none_and_false_not_exceptions(memory_swarm):
    swarm = await memory_swarm(4)
    client = await swarm.add(client_mode=True)
    for node in list(swarm.nodes):
        if node is not client:
            await swarm.kill(node)
    assert await client.get("anything") is None
    failed = await client.get_outcome("anything")
    assert failed.value is None and failed.reason in ("no node answered", "no known peers")
    outcome = await client.store_outcome("anything", 1, get_dht_time() + 60)
    assert not outcome.ok and outcome.reason
    assert client.num_known_peers == 0


async def test_cache_answers_recent_reads_and_latest_bypasses_it(memory_swarm):
    swarm = await memory_swarm(12, config=DHTConfig(bucket_size=4, rpc_timeout_s=2.0))
    key_id = DHTID.from_key("cached")
    reader = farthest(swarm, "cached")
    writer = next(n for n in swarm.nodes if n is not reader)
    now = get_dht_time()
    assert await writer.store("cached", "v1", now + 100)
    first = await reader.get_outcome("cached")
    assert first.source == "network" and first.hops >= 1 and first.value.value == "v1"
    assert (await reader.get_outcome("cached")).source == "cache"
    assert await writer.store("cached", "v2", now + 200)
    assert (await reader.get("cached")).value == "v1", "a recent read may answer"
    assert (await reader.get("cached", latest=True)).value == "v2"
    assert reader.storage.get(key_id) is None
    # A store from the reader itself invalidates what it cached.
    assert await reader.store("cached", "v3", now + 300)
    assert (await reader.get("cached")).value == "v3"


async def test_cache_entries_age_out(memory_swarm):
    config = DHTConfig(bucket_size=4, cache_max_age_s=0.05, rpc_timeout_s=2.0)
    swarm = await memory_swarm(10, config=config)
    reader = farthest(swarm, "aging")
    assert await swarm.nodes[0].store("aging", 1, get_dht_time() + 100)
    assert (await reader.get_outcome("aging")).source == "network"
    await asyncio.sleep(0.2)
    assert (await reader.get_outcome("aging")).source == "network"
