"""Start a DHT node on its own HTTP transport: the one way every command and test does it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager

from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from dht.reach.reachability import settle_reachability


@asynccontextmanager
async def open_node(
    identity: PeerIdentity,
    transport_config: TransportConfig,
    dht_config: DHTConfig,
    *,
    check_reachability: bool = False,
    relay_via: Sequence[str] = (),
    routes: Iterable[Callable[[HttpTransport], None]] = (),
) -> AsyncIterator[DHTNode]:
    """A started, bootstrapped node; closed (node, then transport) on exit.

    With ``relay_via``, the node is reached through the first of those relays that accepts it.
    Otherwise, with ``check_reachability``, the initial peers are asked to dial it back before
    the node starts; a node nobody can dial is relayed by one of them, or else runs in client
    mode (``node.transport.reachability``, see :mod:`dht.reach.reachability`). ``routes``: each adds
    its plain routes (``GET /metrics``) to the transport before it serves.
    """
    transport = HttpTransport(identity, transport_config)
    for add_routes in routes:
        add_routes(transport)
    node = DHTNode(transport=transport, identity=identity, config=dht_config)
    async with transport:
        if relay_via:  # before the node starts: it joins under its relayed address
            await transport.attach_relay(list(relay_via))
        elif check_reachability:
            await settle_reachability(
                transport,
                dht_config.initial_peers,
                transport_config.reachability,
                relays=dht_config.initial_peers,
            )
        async with node:
            yield node
