"""Start a DHT node on its own HTTP transport: the one way every command and test does it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.http_config import TransportConfig
from dht.identity import PeerIdentity
from dht.node import DHTNode
from dht.reachability import settle_reachability


@asynccontextmanager
async def open_node(
    identity: PeerIdentity,
    transport_config: TransportConfig,
    dht_config: DHTConfig,
    *,
    check_reachability: bool = False,
) -> AsyncIterator[DHTNode]:
    """A started, bootstrapped node; closed (node, then transport) on exit.

    With ``check_reachability``, the initial peers are asked to dial it back before the node
    starts, and a node nobody can dial runs in client mode (``node.transport.reachability``).
    """
    transport = HttpTransport(identity, transport_config)
    node = DHTNode(transport=transport, identity=identity, config=dht_config)
    async with transport:
        if check_reachability:
            await settle_reachability(
                transport, dht_config.initial_peers, transport_config.reachability
            )
        async with node:
            yield node
