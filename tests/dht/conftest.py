"""Swarms of DHT nodes for tests: real ones over HTTP on 127.0.0.1, and in-memory ones.

``dht_swarm(n, ...)`` starts n real nodes (HttpTransport on 127.0.0.1, port 0), each
bootstrapping from up to two random nodes already up; ``memory_swarm(n, ...)`` does the same over
one MemoryNetwork. Both return a :class:`Swarm`; everything is closed when the test ends.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from dht.config import Clock, DHTConfig
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.tools.memory import LatencyModel, MemoryNetwork, MemoryTransport

TransportFactory = Callable[[PeerIdentity, bool], Any]


@dataclass
class Swarm:
    """Running DHT nodes and the means to add, kill and close them."""

    make_transport: TransportFactory
    config: DHTConfig
    clock: Clock | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    nodes: list[DHTNode] = field(default_factory=list)
    killed: list[DHTNode] = field(default_factory=list)
    kill_transport: Callable[[DHTNode], Any] | None = None
    network: MemoryNetwork | None = None

    @property
    def urls(self) -> list[str]:
        return [node.address for node in self.nodes if node.address is not None]

    async def add(
        self, *, client_mode: bool = False, initial_peers: list[str] | None = None, **config_changes
    ) -> DHTNode:
        """Start one more node, bootstrapping from ``initial_peers`` or from up to two random
        running nodes; ``config_changes`` override fields of the swarm's config."""
        urls = self.urls
        initial = (
            self.rng.sample(urls, min(2, len(urls))) if initial_peers is None else initial_peers
        )
        config = replace(self.config, initial_peers=initial, **config_changes)
        identity = PeerIdentity.generate()
        transport = self.make_transport(identity, client_mode)
        node = DHTNode(transport=transport, identity=identity, config=config, clock=self.clock)
        await transport.start()
        try:
            await node.start()
        except BaseException:
            await node.close()
            await transport.close()
            raise
        self.nodes.append(node)
        return node

    async def kill(self, node: DHTNode) -> None:
        """Stop ``node`` abruptly: its address stops answering, it says goodbye to no one."""
        self.nodes.remove(node)
        self.killed.append(node)
        await node.close()
        if self.kill_transport is not None:
            self.kill_transport(node)
        await node.transport.close()

    async def close(self) -> None:
        for node in self.nodes:
            await node.close()
            await node.transport.close()
        self.nodes.clear()


async def _start(swarm: Swarm, num_nodes: int) -> Swarm:
    for _ in range(num_nodes):
        await swarm.add()
    return swarm


@pytest.fixture
async def memory_swarm():
    """Factory: ``await memory_swarm(n, config=..., clock=..., latency=...)``."""
    swarms: list[Swarm] = []

    async def make(
        num_nodes: int,
        *,
        config: DHTConfig | None = None,
        clock: Clock | None = None,
        latency: LatencyModel | None = None,
    ) -> Swarm:
        network = MemoryNetwork(latency, seed=0)

        def make_transport(identity: PeerIdentity, client_mode: bool) -> MemoryTransport:
            return MemoryTransport(
                network, identity.peer_id, client_mode=client_mode, request_timeout_s=5.0
            )

        swarm = Swarm(
            make_transport,
            config or DHTConfig(rpc_timeout_s=2.0),
            clock,
            kill_transport=lambda node: network.kill(node.address),
            network=network,
        )
        swarms.append(swarm)
        return await _start(swarm, num_nodes)

    yield make
    for swarm in swarms:
        await swarm.close()


@pytest.fixture
async def dht_swarm():
    """Factory: ``await dht_swarm(n, config=..., clock=..., swarm_key=...)``: real nodes on
    127.0.0.1, each with its own HttpTransport."""
    from dht.http import HttpTransport, TransportConfig

    swarms: list[Swarm] = []

    async def make(
        num_nodes: int,
        *,
        config: DHTConfig | None = None,
        clock: Clock | None = None,
        swarm_key: bytes | None = None,
    ) -> Swarm:
        def make_transport(identity: PeerIdentity, client_mode: bool) -> HttpTransport:
            return HttpTransport(
                identity,
                TransportConfig(
                    host="127.0.0.1", port=0, client_mode=client_mode, swarm_key=swarm_key
                ),
            )

        swarm = Swarm(make_transport, config or DHTConfig(rpc_timeout_s=5.0), clock)
        swarms.append(swarm)
        return await _start(swarm, num_nodes)

    yield make
    for swarm in swarms:
        await swarm.close()
