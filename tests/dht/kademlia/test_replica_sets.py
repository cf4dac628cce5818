"""A key stored again goes straight to the nodes that took its last store
(dht.kademlia.replica_sets), over real nodes on 127.0.0.1."""

from __future__ import annotations

import pytest

from dht.kademlia.node import get_dht_time
from dht.kademlia.replica_sets import ReplicaSets
from dht.kademlia.routing import DHTID, PeerInfo

pytestmark = pytest.mark.timeout(90)

KEY = "run/progress/1/0"
REPLICAS = 4


async def held(nodes, value) -> bool:
    """Whether each of ``nodes`` holds ``value`` itself (its own replica, read locally)."""
    return [(await node.get(KEY)).value for node in nodes] == [value] * len(nodes)


async def test_a_key_stored_again_skips_its_lookup_until_a_replica_is_lost(dht_swarm):
    swarm = await dht_swarm(16)
    key_id = DHTID.from_key(KEY)

    def closest():  # the reference: the live nodes closest to the key, by XOR distance
        return sorted(swarm.nodes, key=lambda node: node.node_id ^ key_id)[:REPLICAS]

    writer = sorted(swarm.nodes, key=lambda node: node.node_id ^ key_id)[-1]
    expiration = get_dht_time() + 60

    finds = []  # the writer's find requests (a lookup's), counted on their way out
    real_find = writer.protocol.find

    async def counted_find(peer, key_id, *, want_value):
        finds.append(peer)
        return await real_find(peer, key_id, want_value=want_value)

    writer.protocol.find = counted_find

    async def store(value) -> tuple[int, object]:
        """Store ``value``; returns the finds it sent and its outcome."""
        finds.clear()
        outcome = await writer.store_outcome(KEY, value, expiration + value, replicas=REPLICAS)
        return len(finds), outcome

    first_finds, outcome = await store(1)
    assert outcome.ok and outcome.num_accepted == REPLICAS
    assert await held(closest(), 1)
    # the same key again: straight to the replicas, no find
    second_finds, outcome = await store(2)
    assert second_finds == 0 < first_finds
    assert outcome.num_accepted == REPLICAS and await held(closest(), 2)
    # a replica leaves: the store passes it over for the next closest live node...
    lost = closest()[0]
    await swarm.kill(lost)
    _, outcome = await store(3)
    assert outcome.num_accepted == REPLICAS and await held(closest(), 3)
    assert lost.node_id not in {p.node_id for p in writer.replica_sets.get(key_id)}
    # ... which takes the next store, again without a find
    fourth_finds, outcome = await store(4)
    assert fourth_finds == 0 and outcome.num_accepted == REPLICAS
    assert await held(closest(), 4)
    # too few replicas answer (no node is left beyond them): the key is looked up next time
    for node in list(swarm.nodes):
        if node is not writer and node not in closest():
            await swarm.kill(node)
    await swarm.kill(closest()[0])
    _, outcome = await store(5)
    assert writer.replica_sets.get(key_id) is None


def test_a_set_stands_in_for_a_lookup_for_max_age_from_its_lookup():
    now = [0.0]
    sets = ReplicaSets(max_age_s=60.0, max_keys=2, monotonic=lambda: now[0])
    nodes = [PeerInfo.of("a" * 64, "http://127.0.0.1:1")]
    sets.put(1, nodes)
    now[0] = 50.0
    sets.put(1, nodes)  # stored again through the set: its age still counts from the lookup
    assert sets.get(1) == nodes
    now[0] = 60.5
    assert sets.get(1) is None
    for key_id in (2, 3, 4):  # the least recently stored is forgotten first
        sets.put(key_id, nodes)
    assert sets.get(2) is None and sets.get(4) == nodes
    off = ReplicaSets(max_age_s=0.0)
    off.put(1, nodes)
    assert off.get(1) is None
