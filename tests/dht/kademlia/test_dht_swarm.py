"""The DHT over the real HttpTransport: 30 nodes on 127.0.0.1, each on its own port."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from dht.errors import RemoteError, TransportError
from dht.kademlia.config import DHTConfig
from dht.kademlia.node import ValueWithExpiration, get_dht_time
from dht.kademlia.protocol import FIND, STORE
from dht.kademlia.routing import DHTID
from dht.kademlia.storage import Record
from dht.kademlia.validation import owner_subkey, signed_bytes
from dht.net.wire import pack

pytestmark = pytest.mark.timeout(90)

NUM_NODES = 30


class FakeClock:
    """Expirations without waiting: every node of the swarm reads this one clock."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


def _store_payload(key: str, subkey, record: Record) -> dict:
    raw_key = DHTID.from_key(key).to_raw()
    return {
        "addr": None,
        "records": [[raw_key, subkey, record.value_bytes, record.expiration_time,
                     record.signature]],
    }  # fmt: skip


async def test_every_value_is_found_from_every_node(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    rng = random.Random(1)
    expiration = get_dht_time() + 120
    values = {f"value-{i}": {"i": i, "blob": rng.randbytes(16)} for i in range(10)}
    for key, value in values.items():
        assert await rng.choice(swarm.nodes).store(key, value, expiration)
    for node in swarm.nodes:
        for key, value in values.items():
            assert await node.get(key) == ValueWithExpiration(value, expiration), (node, key)


async def test_dictionary_subkeys_from_different_writers_merge(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    now = get_dht_time()
    writers = random.Random(2).sample(swarm.nodes, 6)
    for i, writer in enumerate(writers):
        subkey = owner_subkey(writer.peer_id) if i % 2 else f"free-{i}"
        assert await writer.store("run/progress", {"samples": i}, now + 60 + i, subkey=subkey)
    expected = {
        owner_subkey(w.peer_id) if i % 2 else f"free-{i}": ValueWithExpiration({"samples": i},
                                                                               now + 60 + i)
        for i, w in enumerate(writers)
    }  # fmt: skip
    for node in swarm.nodes:
        found = await node.get("run/progress", latest=True)
        assert found == ValueWithExpiration(expected, now + 65)


async def test_expiration_removes_values(dht_swarm):
    clock = FakeClock()
    swarm = await dht_swarm(NUM_NODES, clock=clock)
    writer = swarm.nodes[3]
    assert await writer.store("ephemeral", "soon gone", clock.now + 30)
    assert await writer.store("ephemeral-dict", 1, clock.now + 30, subkey="a")
    assert await writer.store("ephemeral-dict", 2, clock.now + 90, subkey="b")
    for node in swarm.nodes:
        assert (await node.get("ephemeral")).value == "soon gone"
    clock.now += 31
    for node in swarm.nodes:
        assert await node.get("ephemeral") is None
        assert await node.get("ephemeral", latest=True) is None
        found = await node.get("ephemeral-dict", latest=True)
        assert found == ValueWithExpiration({"b": ValueWithExpiration(2, clock.now + 59)},
                                            clock.now + 59)  # fmt: skip
    for node in swarm.nodes:
        node.storage.purge_expired()
    assert not any(node.storage.get(DHTID.from_key("ephemeral")) for node in swarm.nodes)


async def test_newer_expiration_wins(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    a, b, c = random.Random(3).sample(swarm.nodes, 3)
    now = get_dht_time()
    assert await a.store("config", "first", now + 100)
    assert not await b.store("config", "stale write", now + 50)
    assert await c.store("config", "second", now + 200)
    for node in swarm.nodes:
        assert await node.get("config", latest=True) == ValueWithExpiration("second", now + 200)


async def test_values_survive_a_third_of_the_nodes_dying(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    rng = random.Random(4)
    expiration = get_dht_time() + 120
    for i in range(15):
        assert await rng.choice(swarm.nodes).store(f"durable-{i}", [i], expiration)
    for node in rng.sample(swarm.nodes, NUM_NODES // 3):
        await swarm.kill(node)
    assert len(swarm.nodes) == NUM_NODES - NUM_NODES // 3
    for node in swarm.nodes:
        for i in range(15):
            assert await node.get(f"durable-{i}") == ValueWithExpiration([i], expiration)
    # Values stored after the deaths land on live nodes only, and are found too.
    writer = rng.choice(swarm.nodes)
    outcome = await writer.store_outcome("after-churn", "ok", expiration)
    # Every target accepted: no store went to a dead node. Until buckets refresh, routing tables
    # still name the dead and an answer lists only its k closest, so the live nodes farthest
    # from the key can go unseen, and on a loaded host a live node whose answer comes after the
    # RPC timeout counts as failed (here every live node is one of the 20 replicas: 20 of 20 on
    # an idle host, 18 in a CI run): most of the replicas hold it, and every node finds it.
    num_replicas = writer.config.num_replicas
    assert outcome.ok and outcome.num_accepted == outcome.num_targets >= num_replicas * 3 // 4
    for node in swarm.nodes:
        assert (await node.get("after-churn", latest=True)).value == "ok"


async def test_forged_write_to_another_peers_subkey_is_refused(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    alice, mallory = swarm.nodes[1], swarm.nodes[2]
    subkey = owner_subkey(alice.peer_id)
    now = get_dht_time()
    assert await alice.store("run/state", {"epoch": 5}, now + 100, subkey=subkey)
    assert not await mallory.store("run/state", {"epoch": 666}, now + 500, subkey=subkey)

    value = pack({"epoch": 666})
    signature = mallory.identity.sign(
        signed_bytes(DHTID.from_key("run/state"), subkey, value, now + 500)
    )
    for forged in (Record(value, now + 500, signature), Record(value, now + 500, None)):
        for node in swarm.nodes:
            if node is mallory:
                continue
            with pytest.raises(RemoteError) as refused:
                await mallory.transport.call(
                    node.address, "dht.store", _store_payload("run/state", subkey, forged)
                )
            assert refused.value.status == 422
    for node in swarm.nodes:
        found = await node.get("run/state", latest=True)
        assert found.value == {subkey: ValueWithExpiration({"epoch": 5}, now + 100)}


async def test_replayed_old_record_is_refused(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    alice, mallory = swarm.nodes[4], swarm.nodes[5]
    subkey = owner_subkey(alice.peer_id)
    key_id = DHTID.from_key("run/progress")
    now = get_dht_time()
    assert await alice.store("run/progress", {"epoch": 1}, now + 100, subkey=subkey)
    old = next(n.storage.get(key_id) for n in swarm.nodes if n.storage.get(key_id))[subkey]
    assert await alice.store("run/progress", {"epoch": 2}, now + 200, subkey=subkey)
    # The replicas of the newer record must refuse the replay. (A node that kept only the old
    # one, a stray copy beyond the 20 closest, would take it again as the same record.)
    replicas = [
        n
        for n in swarm.nodes
        if n is not mallory and (n.storage.get(key_id) or {}).get(subkey, old) != old
    ]
    assert replicas
    for node in replicas:
        answer = await mallory.transport.call(
            node.address, "dht.store", _store_payload("run/progress", subkey, old)
        )
        assert answer["accepted"] == [False]
    for node in swarm.nodes:
        found = await node.get("run/progress", latest=True)
        assert found.value[subkey] == ValueWithExpiration({"epoch": 2}, now + 200)


async def test_client_mode_node_stores_and_gets_through_others(dht_swarm):
    swarm = await dht_swarm(NUM_NODES)
    client = await swarm.add(client_mode=True)
    assert client.address is None and client.num_known_peers > 0
    servers = [node for node in swarm.nodes if node is not client]
    now = get_dht_time()
    assert await client.store("from-client", {"hello": "swarm"}, now + 60)
    assert await client.store("progress", 7, now + 60, subkey=owner_subkey(client.peer_id))
    assert await servers[0].store("to-client", [1, 2], now + 60)
    for node in servers:
        assert (await node.get("from-client")).value == {"hello": "swarm"}
        found = await node.get("progress", latest=True)
        assert found.value[owner_subkey(client.peer_id)].value == 7
        assert client.node_id not in node.routing
    assert (await client.get("to-client")).value == [1, 2]
    assert len(client.storage) == 0


async def test_swarm_key_keeps_outsiders_out(dht_swarm):
    members = await dht_swarm(8, swarm_key=b"k" * 32)
    now = get_dht_time()
    assert await members.nodes[0].store("members-only", 1, now + 60)
    assert (await members.nodes[-1].get("members-only", latest=True)).value == 1
    outsiders = await dht_swarm(0, swarm_key=b"x" * 32)
    with pytest.raises(TransportError, match="initial peers"):
        await outsiders.add(initial_peers=members.urls[:2], bootstrap_timeout_s=1.0)


async def test_a_bounded_latest_read_keeps_what_the_replicas_that_answered_hold(dht_swarm):
    # a matchmaking read must end within its wait; on a busy host every replica answers late
    # (a lookup of 20 replicas, 3 requests at a time, took longer than that wait), and a
    # bound around the whole read then threw away the answers that had come
    swarm = await dht_swarm(24)
    key, expiration = "run/mm.3", get_dht_time() + 60
    writers = swarm.nodes[:8]
    for writer in writers:
        assert await writer.store(key, {"w": 1}, expiration, subkey=owner_subkey(writer.peer_id))
    target = DHTID.from_key(key)
    reader = max(swarm.nodes, key=lambda node: node.node_id ^ target)
    for node in swarm.nodes:
        answer = node.transport._rpc_handlers[FIND]

        async def late(context, payload, answer=answer):
            await asyncio.sleep(0.4)
            return await answer(context, payload)

        node.transport.add_rpc_handler(FIND, late)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await reader.get(key, latest=True)
    found = await reader.get(key, latest=True, timeout_s=1.0)
    assert found is not None
    assert set(found.value) == {owner_subkey(w.peer_id) for w in writers}
    # a bound before any answer: nothing, and the outcome says it was the bound, not the key
    missed = await reader.get_outcome("run/mm.4", latest=True, timeout_s=0.1)
    assert missed.value is None and missed.reason == "no node answered in time"


@pytest.mark.parametrize("hung", [STORE, FIND], ids=["a replica's store", "the lookup"])
async def test_a_bounded_store_counts_the_replicas_that_took_it_by_its_bound(dht_swarm, hung):
    # a matchmaking announcement must be stored within its wait. On a busy host a bound around
    # the whole store ran out either in the lookup before it (a matchmaking key is new every
    # epoch), before any replica was asked: nothing was stored and nobody found the peer; or
    # while one replica held the store up to its RPC timeout: the announcement was on the
    # others, and reported lost
    rpc_timeout_s, bound_s = 30.0, 2.0
    swarm = await dht_swarm(24, config=DHTConfig(rpc_timeout_s=rpc_timeout_s))
    key, expiration = f"run/mm.{hung}", get_dht_time() + 60
    target = DHTID.from_key(key)
    by_distance = sorted(swarm.nodes, key=lambda node: node.node_id ^ target)
    writer, hanging = by_distance[-1], by_distance[0]
    answer = hanging.transport._rpc_handlers[hung]
    released = asyncio.Event()

    async def never(context, payload):
        await released.wait()  # past the writer's RPC timeout: the test releases it
        return await answer(context, payload)

    hanging.transport.add_rpc_handler(hung, never)
    subkey = owner_subkey(writer.peer_id)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(bound_s):
            await writer.store(key, {"w": 1}, expiration, subkey=subkey)
    if hung == FIND:  # it ran out in the lookup: no node holds anything
        assert not [node for node in by_distance[1:-1] if node.storage.get(target) is not None]
    # bounded: it ends long before the hanging node's RPC times out
    async with asyncio.timeout(rpc_timeout_s / 2):
        outcome = await writer.store_outcome(
            key, {"w": 2}, expiration, subkey=subkey, timeout_s=bound_s
        )
    assert outcome.ok, outcome
    if hung == STORE:  # every replica but the hanging one took it, or the next closest did
        assert outcome.num_accepted >= writer.config.num_replicas - 1, outcome
    released.set()  # the read asks the closest node too
    found = await by_distance[-2].get(key, latest=True)
    assert found is not None and found.value[subkey].value == {"w": 2}
