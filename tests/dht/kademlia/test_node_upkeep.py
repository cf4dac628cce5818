"""DHTNode's upkeep over the in-memory transport: bootstrap, full buckets, republishing,
refreshes, closing, its config, and the memory transport itself (the rest of the node's
behaviour is in test_node_memory.py)."""

from __future__ import annotations

import pytest

from dht.config import DHTConfig
from dht.errors import (
    ConfigError,
    RemoteError,
    RequestTimeoutError,
    TransportError,
    ValidationError,
)
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode, get_dht_time
from dht.kademlia.routing import DHTID, MAX_ID, PeerInfo
from dht.kademlia.storage import Record
from dht.net.wire import pack
from dht.tools.memory import LatencyModel, MemoryNetwork, MemoryTransport
from tests.dht.kademlia.test_node_memory import FakeClock, closest, holders
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


async def test_bootstrap_fills_routing_and_bad_initial_peers_raise(memory_swarm):
    swarm = await memory_swarm(15)
    assert all(node.num_known_peers >= 10 for node in swarm.nodes)
    identity = PeerIdentity.generate()
    transport = MemoryTransport(swarm.network, identity.peer_id)
    node = DHTNode(
        transport=transport,
        identity=identity,
        config=DHTConfig(initial_peers=["mem://nobody"], bootstrap_timeout_s=1.0),
    )
    await transport.start()
    with pytest.raises(TransportError, match="initial peers"):
        await node.start()
    await node.close()
    await transport.close()


def _far_identities(own_id: int, count: int) -> list[PeerIdentity]:
    """Identities whose node ids lie in the half of the id space that ``own_id`` is not in."""
    found = []
    while len(found) < count:
        identity = PeerIdentity.generate()
        if (DHTID.from_peer_id(identity.peer_id) ^ own_id) >= MAX_ID // 2:
            found.append(identity)
    return found


@pytest.mark.parametrize("oldest_alive", [True, False])
async def test_full_bucket_pings_its_oldest_node(oldest_alive):
    network = MemoryNetwork()
    config = DHTConfig(bucket_size=2, liveness_check_after_s=0.0, rpc_timeout_s=2.0)
    owner = PeerIdentity.generate()
    own_node_id = DHTID.from_peer_id(owner.peer_id)
    nodes = []
    for identity in [owner, *_far_identities(own_node_id, 3)]:
        transport = MemoryTransport(network, identity.peer_id)
        nodes.append(DHTNode(transport=transport, identity=identity, config=config))
        await transport.start()
    a, oldest, middle, newcomer = nodes
    try:
        as_peer = [PeerInfo.of(n.peer_id, n.address) for n in nodes]
        a.protocol.note_contact(as_peer[1])
        a.protocol.note_contact(as_peer[2])
        if not oldest_alive:
            network.kill(oldest.address)
        a.protocol.note_contact(as_peer[3])
        bucket = a.routing.bucket_of(newcomer.node_id)
        if oldest_alive:
            await wait_until(lambda: list(bucket.nodes)[-1] == oldest.node_id, timeout_s=10.0)
            assert newcomer.node_id in bucket.replacements and newcomer.node_id not in a.routing
        else:
            await wait_until(lambda: newcomer.node_id in a.routing, timeout_s=10.0)
            assert oldest.node_id not in a.routing and middle.node_id in a.routing
    finally:
        for node in nodes:
            await node.close()
            await node.transport.close()


async def test_republish_restores_values_on_the_closest_nodes(memory_swarm):
    config = DHTConfig(bucket_size=4, republish_interval_s=0.2, rpc_timeout_s=2.0)
    swarm = await memory_swarm(12, config=config)
    key_id = DHTID.from_key("republished")
    keeper = swarm.nodes[0]
    record = Record(pack("kept"), get_dht_time() + 100)
    keeper.storage.store(key_id, record)  # held by one node only, as after heavy churn
    expected = closest(swarm, "republished", 4) | {keeper.peer_id}
    await wait_until(lambda: expected <= holders(swarm, "republished"), timeout_s=10.0)
    for peer_id in expected:
        node = next(n for n in swarm.nodes if n.peer_id == peer_id)
        assert node.storage.get(key_id) == record


async def test_refresh_looks_up_idle_buckets_and_purges(memory_swarm):
    clock = FakeClock()
    swarm = await memory_swarm(8, clock=clock)
    node = swarm.nodes[0]
    node.storage.store(1, Record(pack("x"), clock.now + 5))
    clock.now += 10
    num_sent = node.protocol.num_requests_sent
    num_refreshed = await node.maintenance.refresh()
    assert num_refreshed == 0 and len(node.storage) == 0
    for bucket in node.routing.buckets:
        bucket.last_updated_s -= node.config.refresh_interval_s
    assert await node.maintenance.refresh() == len(node.routing.buckets)
    assert node.protocol.num_requests_sent > num_sent


async def test_close_is_safe_twice_and_async_with_works(memory_swarm):
    swarm = await memory_swarm(2)
    identity = PeerIdentity.generate()
    transport = MemoryTransport(swarm.network, identity.peer_id)
    node = DHTNode(
        transport=transport, identity=identity, config=DHTConfig(initial_peers=swarm.urls)
    )
    async with transport:
        async with node:
            assert node.num_known_peers == 2
            assert await node.store("ctx", 1, get_dht_time() + 10)
        await node.close()
        with pytest.raises(RemoteError) as refused:  # a closed node answers nothing useful
            await swarm.nodes[0].transport.call(transport.address, "dht.ping", {"addr": None})
        assert refused.value.status == 500


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bucket_size", 0),
        ("alpha", 0),
        ("num_replicas", 0),
        ("rpc_timeout_s", 0),
        ("refresh_interval_s", -1),
        ("cache_max_entries", -1),
        ("max_value_bytes", 0),
        ("initial_peers", ["localhost:80"]),
        ("initial_peers", "http://a:1"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        DHTConfig(**{field: value})


def test_config_defaults():
    config = DHTConfig(initial_peers=["http://127.0.0.1:1"])
    assert config.num_replicas == 20 and config.bucket_size == 20 and config.alpha == 3
    assert DHTConfig(bucket_size=3).num_replicas == 3  # no more replicas than a lookup finds
    assert config.initial_peers == ("http://127.0.0.1:1",)


async def test_memory_transport_behaves_like_the_wire():
    network = MemoryNetwork()
    alice, bob = PeerIdentity.generate(), PeerIdentity.generate()
    client = MemoryTransport(network, alice.peer_id)
    server = MemoryTransport(network, bob.peer_id)
    seen = []

    async def echo(ctx, payload):
        seen.append(ctx.sender)
        if payload == "refuse":
            raise ValidationError("no")
        return {"echo": payload}

    server.add_rpc_handler("echo", echo)
    async with client, server:
        assert server.address.startswith("mem://")
        assert await client.call(server.address, "echo", (1, b"x")) == {"echo": [1, b"x"]}
        assert seen == [alice.peer_id]
        assert client.counters.per_peer[bob.peer_id].sent > 0
        with pytest.raises(RemoteError) as refused:
            await client.call(server.address, "echo", "refuse")
        assert refused.value.status == 422
        with pytest.raises(RemoteError) as missing:
            await client.call(server.address, "nothing", 1)
        assert missing.value.status == 404
        network.latency = LatencyModel(drop_probability=0.999)
        with pytest.raises(RequestTimeoutError):
            await client.call(server.address, "echo", 1, timeout_s=0.05)
        network.latency = LatencyModel()
        network.kill(server.address)
        with pytest.raises(TransportError):
            await client.call(server.address, "echo", 1)
    with pytest.raises(NotImplementedError):
        client.open_stream(server.address, "x", {})
