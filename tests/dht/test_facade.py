"""The blocking DHT, as the training loop uses it from the main thread."""

from __future__ import annotations

import pytest

from dht.config import DHTConfig, get_dht_time
from dht.facade import DHT
from dht.identity import PeerIdentity
from dht.kademlia.validation import owner_subkey
from dht.net.config import TransportConfig
from dht.runtime import EventLoopThread

pytestmark = pytest.mark.timeout(60)


def test_blocking_store_and_get_between_two_processes_worth_of_nodes():
    shared_loop = EventLoopThread()
    try:
        with DHT(
            identity=PeerIdentity.generate(),
            transport_config=TransportConfig(),
            dht_config=DHTConfig(),
        ) as first:
            second = DHT(
                identity=PeerIdentity.generate(),
                transport_config=TransportConfig(),
                dht_config=DHTConfig(initial_peers=[first.address]),
                loop_thread=shared_loop,
            )
            client = DHT(
                identity=PeerIdentity.generate(),
                transport_config=TransportConfig(client_mode=True),
                dht_config=DHTConfig(initial_peers=[first.address]),
                loop_thread=shared_loop,
            )
            expiration = get_dht_time() + 60
            assert first.store(
                "run/progress", {"epoch": 3}, expiration, subkey=owner_subkey(first.peer_id)
            )
            assert client.store(
                "run/progress", {"epoch": 4}, expiration, subkey=owner_subkey(client.peer_id)
            )
            found = second.get("run/progress", latest=True)
            assert {k: v.value for k, v in found.value.items()} == {
                owner_subkey(first.peer_id): {"epoch": 3},
                owner_subkey(client.peer_id): {"epoch": 4},
            }
            assert client.address is None
            client.close()
            second.close()
            second.close()  # safe twice
        assert shared_loop.loop.is_running()  # a DHT that does not own the loop leaves it be
    finally:
        shared_loop.close()
        shared_loop.close()
