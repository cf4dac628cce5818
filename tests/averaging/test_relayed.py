"""A swarm of one reachable peer (the relay) and two peers reached only through it averages:
by default the relayed peers average as clients; with ``relayed_reduces`` they reduce parts,
every byte of them through the relay."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from averaging.averager import DecentralizedAverager
from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from tests.dht.reach import test_relay_failover

from .conftest import Peer, exact_mean, fast_config

relays = test_relay_failover.relays  # the fixture: two ``peer dht`` processes

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def relayed_swarm():
    started: list[Peer] = []

    async def make(vectors, config) -> list[Peer]:
        relay_url = None
        for vector in vectors:
            identity = PeerIdentity.generate()
            transport = HttpTransport(identity, TransportConfig())
            node = DHTNode(
                transport=transport,
                identity=identity,
                config=DHTConfig(initial_peers=[relay_url] if relay_url else [], rpc_timeout_s=2.0),
            )
            tensors = [vector.copy()]
            averager = DecentralizedAverager(
                tensors, transport=transport, dht=node, prefix="t", config=config
            )
            await transport.start()
            if relay_url is None:
                relay_url = transport.address
            else:  # attached before the DHT starts: it joins under its relayed address
                await transport.attach_relay([relay_url])
            await node.start()
            started.append(Peer(transport, averager, tensors, node))
        return list(started)

    yield make
    for peer in reversed(started):
        await peer.averager.close()
        await peer.node.close()
        await peer.transport.close()


@pytest.mark.parametrize("relayed_reduces", [False, True])
async def test_two_relayed_peers_and_their_relay_average_to_the_exact_mean(
    relayed_swarm, relayed_reduces
):
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(300_000).astype(np.float32) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    # four streams per pair, as the automatic choice takes on a slow link: a relayed reducer
    # still gets one per sender (they all cross its one tunnel, and each holds a relay slot)
    config = fast_config(
        target_group_size=3,
        relayed_reduces=relayed_reduces,
        max_streams_per_pair=4,
        streams_per_pair=4,
    )
    peers = await relayed_swarm(vectors, config)
    relay = peers[0].transport
    assert all(p.transport.relayed for p in peers[1:]) and not relay.relayed
    assert [p.averager.client_mode for p in peers] == [
        False,
        not relayed_reduces,
        not relayed_reduces,
    ]
    results = await asyncio.gather(
        *(p.averager.step(weight=w, epoch=3) for p, w in zip(peers, weights, strict=True))
    )
    assert [r.status for r in results] == ["ok"] * 3
    expected = exact_mean(vectors, weights)
    for peer in peers:
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(peers[1].tensors[0], peers[0].tensors[0])
    np.testing.assert_array_equal(peers[2].tensors[0], peers[0].tensors[0])
    if relayed_reduces:  # the relayed peers' parts came in and went out through the relay
        assert relay.relay.num_relayed_bytes > vectors[0].nbytes


async def test_a_relay_killed_mid_round_costs_at_most_that_round(relays):
    """Two ``peer dht`` processes relay; the one both relayed peers use is SIGKILLed as a
    round starts (relayed clients send and receive over their own outbound connections, so the
    round itself needs no relay). The next round, after both moved to the other relay, is
    exact."""
    (relay_a, url_a), (_, url_b) = relays
    rng = np.random.default_rng(8)
    weights = [3.0, 1.0, 2.0]
    config = fast_config(target_group_size=3)
    started: list[Peer] = []
    try:
        for index in range(3):
            identity = PeerIdentity.generate()
            transport = HttpTransport(identity, TransportConfig(relay_heartbeat_s=1.0))
            node = DHTNode(
                transport=transport,
                identity=identity,
                config=DHTConfig(initial_peers=[url_a, url_b], rpc_timeout_s=2.0),
            )
            tensors = [rng.standard_normal(200_000).astype(np.float32)]
            averager = DecentralizedAverager(
                tensors, transport=transport, dht=node, prefix="t", config=config
            )
            await transport.start()
            if index:
                await transport.attach_relay([url_a, url_b])
            await node.start()
            started.append(Peer(transport, averager, tensors, node))
        first = [
            asyncio.create_task(p.averager.step(weight=w, epoch=1))
            for p, w in zip(started, weights, strict=True)
        ]
        await asyncio.sleep(0.05)
        relay_a.kill()
        await asyncio.gather(*first)  # whatever came of it, it ended (typed results)
        async with asyncio.timeout(30):
            for _ in iter(int, 1):  # until both relayed peers moved to the other relay
                if all(p.transport.relay_url == url_b for p in started[1:]):
                    break
                await asyncio.sleep(0.05)
        before = [p.tensors[0].copy() for p in started]
        results = await asyncio.gather(
            *(p.averager.step(weight=w, epoch=2) for p, w in zip(started, weights, strict=True))
        )
        assert [r.status for r in results] == ["ok"] * 3
        expected = exact_mean(before, weights)
        for peer in started:
            np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
    finally:
        for peer in reversed(started):
            await peer.averager.close()
            await peer.node.close()
            await peer.transport.close()
