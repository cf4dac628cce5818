"""``peer.DHT`` called as hivemind's tests and its DHT guide call ``hivemind.DHT`` (written here
in their style: the same calls and checks, with ``from peer import DHT``); one small swarm is
shared by the module."""

from __future__ import annotations

import asyncio
import logging

import pytest

from peer import DHT, get_dht_time
from peer.api.maddr import Multiaddr

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def swarm():
    """Three peers joined the way hivemind's test helpers join them (in the background)."""
    first = DHT(start=True)
    initial_peers = first.get_visible_maddrs()
    others = [DHT(initial_peers=initial_peers, start=True, await_ready=False) for _ in range(2)]
    for other in others:
        other.wait_until_ready()
    yield [first, *others]
    for node in [first, *others]:
        node.shutdown()


def test_store_and_get_as_hiveminds_test_get_store(swarm):
    node1, node2, _ = swarm
    assert node1.store("key1", "value1", expiration_time=get_dht_time() + 30)
    assert node1.get("key1").value == "value1"
    assert node2.get("key1").value == "value1"
    assert node2.get("key2") is None

    future = node1.get("foo", return_future=True)
    assert future.result() is None
    future = node1.get("foo", return_future=True)
    future.cancel()

    assert node2.store("key1", 123, expiration_time=get_dht_time() + 31)
    assert node2.store("key2", 456, expiration_time=get_dht_time() + 32)
    assert node1.get("key1", latest=True).value == 123
    assert node1.get("key2").value == 456

    assert node1.store("key2", subkey="subkey1", value=789, expiration_time=get_dht_time() + 32)
    assert node2.store("key2", subkey="subkey2", value="pew", expiration_time=get_dht_time() + 32)
    found_dict = node1.get("key2", latest=True).value
    assert isinstance(found_dict, dict) and len(found_dict) == 2
    assert found_dict["subkey1"].value == 789 and found_dict["subkey2"].value == "pew"


def test_the_dht_guides_tuple_value_unpacks_and_stays_a_tuple(swarm):
    dht, dht2, _ = swarm
    store_ok = dht.store("my_key", ("i", "love", "bees"), expiration_time=get_dht_time() + 600)
    assert store_ok
    value, expiration = dht2.get("my_key", latest=True)
    assert value == ("i", "love", "bees") and isinstance(value, tuple)
    assert expiration > get_dht_time()
    found = dht2.get("my_key")
    assert found[0] == found.value and found[1] == found.expiration_time


def test_the_dht_guides_party_with_subkeys(swarm):
    alice, bob, carol = swarm
    alice.store("party", subkey="alice", value="yes", expiration_time=get_dht_time() + 600)
    bob.store("party", subkey="bob", value="yes", expiration_time=get_dht_time() + 600)
    carol.store("party", subkey="carol", value="no", expiration_time=get_dht_time() + 600)
    attendees, expiration = alice.get("party", latest=True)
    assert {name: value for name, (value, _) in attendees.items()} == {
        "alice": "yes",
        "bob": "yes",
        "carol": "no",
    }
    assert expiration == max(entry.expiration_time for entry in attendees.values())


def test_tuple_keys_subkeys_and_nested_tuples(swarm):
    node1, node2, _ = swarm
    value = {"shape": (2, 3), "layers": [("linear", (4, 5)), ("relu", ())]}
    assert node1.store(("expert", 7), value, expiration_time=get_dht_time() + 60)
    assert node2.get(("expert", 7), latest=True).value == value
    assert node1.store("grid", ("x", 1), get_dht_time() + 60, subkey=(0, 1))
    entries = node2.get("grid", latest=True).value
    assert entries[(0, 1)].value == ("x", 1)
    assert node2.get(("expert", 8)) is None


def test_return_future_result_await_and_store(swarm):
    node1, node2, _ = swarm
    stored = node1.store("later", [1, 2], expiration_time=get_dht_time() + 30, return_future=True)
    assert stored.result(timeout=30) is True

    async def in_a_loop():
        return await node2.get("later", latest=True, return_future=True)

    assert asyncio.run(in_a_loop()).value == [1, 2]


def test_run_coroutine_runs_on_the_node(swarm):
    node1 = swarm[0]

    async def my_peer_id(dht, node):
        return node.peer_id

    assert node1.run_coroutine(my_peer_id) == node1.peer_id
    assert node1.run_coroutine(my_peer_id, return_future=True).result(timeout=30) == node1.peer_id


def test_visible_maddrs_as_hivemind_scripts_read_them(swarm):
    maddrs = swarm[0].get_visible_maddrs()
    assert len(maddrs) == 1
    (maddr,) = maddrs
    assert str(maddr).startswith("/ip4/127.0.0.1/tcp/")
    assert "ip4" in maddr.protocols() and "tcp" in maddr.protocols()
    assert maddr["ip4"] == "127.0.0.1" == maddr.value_for_protocol("ip4")
    assert swarm[0].address.endswith(f":{maddr['tcp']}")


def test_our_multiaddr_without_hivemind_or_py_multiaddr():
    maddr = Multiaddr("/ip4/10.0.0.1/tcp/31337/p2p/QmPeer")
    assert str(maddr) == "/ip4/10.0.0.1/tcp/31337/p2p/QmPeer"
    assert [p.name for p in maddr.protocols()] == ["ip4", "tcp", "p2p"]
    assert "ip4" in maddr.protocols() and "udp" not in maddr
    assert maddr["tcp"] == "31337"
    assert str(maddr.decapsulate("/p2p/QmPeer")) == "/ip4/10.0.0.1/tcp/31337"
    assert maddr.decapsulate("/tcp/31337") == Multiaddr("/ip4/10.0.0.1")
    assert str(Multiaddr("/ip4/10.0.0.1").encapsulate("/udp/1/quic")) == "/ip4/10.0.0.1/udp/1/quic"
    with pytest.raises(KeyError):
        maddr.value_for_protocol("ip6")
    for bad in ("ip4/1.2.3.4", "/ip4/1.2.3.400/tcp/1", "/ip4/1.2.3.4/tcp/70000", "/foo/1"):
        with pytest.raises(ValueError, match="multiaddr"):
            Multiaddr(bad)


def test_hivemind_listen_addresses_udp_and_quic_left_out(caplog, swarm):
    caplog.set_level(logging.INFO)
    with DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic"],
        initial_peers=[*swarm[1].get_visible_maddrs(), "/ip4/127.0.0.1/udp/9/quic"],
        start=True,
    ) as dht:
        assert dht.store("via-tcp", 1, get_dht_time() + 30)
        assert swarm[2].get("via-tcp", latest=True).value == 1
    assert any("TCP only" in r.getMessage() for r in caplog.records)


def test_start_later_node_arguments_and_shutdown(caplog):
    caplog.set_level(logging.INFO, logger="peer.api.errors")
    dht = DHT(start=False, wait_timeout=3, cache_locally=True, num_workers=4, blacklist_time=1.0)
    with pytest.raises(RuntimeError, match="run_in_background"):
        dht.wait_until_ready(timeout=1)
    dht.run_in_background(await_ready=True, timeout=30)
    try:
        assert dht.is_alive() and not dht.client_mode
        assert dht.store("mine", b"\x00", get_dht_time() + 30)
    finally:
        dht.shutdown()
    assert not dht.is_alive()
    lines = [r.getMessage() for r in caplog.records if r.name == "peer.api.errors"]
    assert len(lines) == 1 and "blacklist_time" in lines[0], lines  # the others are defaults


def test_printed_multiaddrs_work_for_peer_join_and_peer_monitor(swarm):
    """A switched script prints ``[str(a) for a in dht.get_visible_maddrs()]``; ``peer join
    --initial-peers`` and ``peer monitor --initial-peers`` take those lines."""
    from dht.options import peer_url
    from peer.run.config import PeerConfig

    printed = [str(a) for a in swarm[0].get_visible_maddrs()]
    assert PeerConfig(initial_peers=printed).initial_peers == [swarm[0].address]
    assert [peer_url(line + "/p2p/QmPeer") for line in printed] == [swarm[0].address]
