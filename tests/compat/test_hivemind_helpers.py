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


def test_choose_ip_address_and_log_visible_maddrs(dht):
    assert choose_ip_address(dht.get_visible_maddrs()) == "127.0.0.1"
    # hivemind's "hivemind" logger does not propagate to the root (where caplog listens) once
    # hivemind has set up its logging, so the records are read at the helper's own logger
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger(log_visible_maddrs.__module__)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        log_visible_maddrs(dht.get_visible_maddrs(), only_p2p=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    port = dht.address.rsplit(":", 1)[1]
    assert any(f"/ip4/127.0.0.1/tcp/{port}" in r.getMessage() for r in records)


def test_a_peer_joins_through_hiveminds_multiaddr_objects(dht):
    with DHT(initial_peers=[Multiaddr(str(m)) for m in dht.get_visible_maddrs()]) as other:
        assert other.initial_peers == [dht.address]
