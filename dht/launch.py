"""Start a DHT node on its own HTTP transport: the one way every command and test does it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.http_config import TransportConfig
from dht.identity import PeerIdentity
from dht.node import DHTNode


@asynccontextmanager
async def open_node(
    identity: PeerIdentity,
    transport_config: TransportConfig,
    dht_config: DHTConfig,
    *,
    routes: Iterable[Callable[[HttpTransport], None]] = (),
) -> AsyncIterator[DHTNode]:
    """A started, bootstrapped node; closed (node, then transport) on exit.

    ``routes``: each adds its plain routes (``GET /metrics``) to the transport before it serves.
    """
    transport = HttpTransport(identity, transport_config)
    for add_routes in routes:
        add_routes(transport)
    node = DHTNode(transport=transport, identity=identity, config=dht_config)
    async with transport, node:
        yield node
