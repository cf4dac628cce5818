"""``peer.DHT`` learns at start whether its initial peers can dial it back, and a peer nobody
can dial is relayed by one of them, or runs in client mode when none relays (real nodes on
loopback; one bound to 127.0.0.2 calls out from 127.0.0.1, so a dial-back to its source IP
finds nobody, as behind a NAT)."""

from __future__ import annotations

import pytest

import peer
from dht.config import get_dht_time

pytestmark = pytest.mark.timeout(60)


def test_peer_dht_says_whether_the_swarm_can_dial_it():
    with peer.DHT() as first:
        assert first.reachability.reachable is None  # the first peer: nobody to ask
        assert first.reachability.reason == "no peers to ask" and not first.client_mode
        with peer.DHT(initial_peers=first.urls) as reachable:
            assert reachable.reachability.reachable is True
            assert reachable.reachability.address == reachable.address is not None
            assert not reachable.client_mode and reachable.urls == [reachable.address]
        with peer.DHT(initial_peers=first.urls, host="127.0.0.2") as hidden:
            assert hidden.reachability.reachable is False
            assert hidden.reachability.observed_host == "127.0.0.1"
            assert hidden.reachability.path == "relayed" and not hidden.client_mode
            assert hidden.address.startswith(f"{first.address}/v2/relay/{hidden.peer_id}")
            assert hidden.store("k", "v", get_dht_time() + 60)
            assert first.get("k").value == "v"
    with peer.DHT(relay=False) as first:  # nobody relays: the hidden peer is a client
        with peer.DHT(initial_peers=first.urls, host="127.0.0.2") as hidden:
            assert hidden.reachability.reachable is False
            assert hidden.client_mode and hidden.address is None and hidden.urls == []
            # a client still stores and reads through the others
            assert hidden.store("k", "v", get_dht_time() + 60)
            assert first.get("k").value == "v"
        with peer.DHT(initial_peers=first.urls, client_mode=True) as client:
            assert client.reachability.reachable is None and client.client_mode
