"""hivemind's own address helpers take what ``peer.DHT.get_visible_maddrs()`` returns (the
hivemind extra installed: its helpers are what a switched script keeps calling)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("hivemind", reason="hivemind's helpers need the [hivemind] extra")

from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.networking import choose_ip_address, log_visible_maddrs

from peer import DHT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def dht():
    with DHT(start=True) as node:
        yield node


def test_maddrs_are_hiveminds_class_once_hivemind_is_imported(dht):
    maddrs = dht.get_visible_maddrs()
    assert all(isinstance(m, Multiaddr) for m in maddrs)
    assert Multiaddr(maddrs[0]) == maddrs[0]  # hivemind's constructor takes them


def test_choose_ip_address_and_log_visible_maddrs(dht, caplog):
    assert choose_ip_address(dht.get_visible_maddrs()) == "127.0.0.1"
    caplog.set_level(logging.INFO)
    log_visible_maddrs(dht.get_visible_maddrs(), only_p2p=False)
    port = dht.address.rsplit(":", 1)[1]
    assert any(f"/ip4/127.0.0.1/tcp/{port}" in r.getMessage() for r in caplog.records)


def test_a_peer_joins_through_hiveminds_multiaddr_objects(dht):
    with DHT(initial_peers=[Multiaddr(str(m)) for m in dht.get_visible_maddrs()]) as other:
        assert other.initial_peers == [dht.address]
