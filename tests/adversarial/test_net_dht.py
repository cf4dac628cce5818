"""Attacks on the DHT: storage flooding by bytes, a plain record squatting a key that peers sign
records under, and lookups fed endless or unreachable nodes.

Honest nodes run as processes; the attacker stores through the real wire protocol with identities
of its own, and a lying node serves the real DHT RPCs with answers of its choosing.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from dht.config import get_dht_time
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.routing import DHTID
from dht.kademlia.validation import owner_subkey, sign_record
from dht.net.config import TransportConfig
from dht.net.wire import pack
from tests.adversarial.harness_net import (
    ATTACKER_HOST,
    WireClient,
    assert_no_crashes,
    assert_serving,
    info_when,
    node_processes,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
KIB = 1 << 10


def signed_store(identity: PeerIdentity, key: str, value: bytes, ttl_s: float) -> list:
    key_id = DHTID.from_key(key)
    subkey = owner_subkey(identity.peer_id)
    packed = pack(value)
    expiration = get_dht_time() + ttl_s
    record = sign_record(identity, key_id, subkey, packed, expiration)
    return [key_id.to_raw(), subkey, packed, expiration, record.signature]


async def test_storage_flooding_by_bytes_stops_at_the_caps(node_processes):  # noqa: F811
    caps = {"max_storage_bytes": 2 * MIB, "max_bytes_per_key": 256 * KIB,
            "max_bytes_per_owner": 128 * KIB}  # fmt: skip
    # (the storage caps, not the shares of requests: 240 stores of 60 KB are 3,600 requests'
    # worth of bytes, past the attacker's share, see test_net_request_shares.py)
    rates = {"max_requests_per_s_per_peer": 1e5, "max_requests_per_s_per_address": 1e5,
             "request_burst_per_peer": 10**5, "request_burst_per_address": 10**5}  # fmt: skip
    a, b = await node_processes(2, dht=caps, transport=rates)
    before = (await a.ask({"cmd": "info"}))["rss_bytes"]
    num_accepted = num_refused = 0
    async with WireClient(local_host=ATTACKER_HOST) as attacker:
        session = await attacker.hello(a.address)
        for _ in range(30):  # fresh identities are free: each writes 8 keys of 60 KB
            sybil = PeerIdentity.generate()
            for k in range(8):
                records = [signed_store(sybil, f"flood/{k}", os.urandom(60_000), 3600.0)]
                answer = await attacker.rpc(
                    a.address, "dht.store", pack({"addr": None, "records": records}),
                    session=session,
                )  # fmt: skip
                assert answer.status == 200, answer
                accepted = answer.message()["accepted"][0]
                num_accepted += accepted
                num_refused += not accepted
    info = await a.ask({"cmd": "info"})
    assert info["storage_bytes"] <= 2 * MIB
    assert num_refused > num_accepted > 0
    # 8 keys x 256 KiB would be 2 MiB: each key holds at most four 60 KB records
    assert num_accepted <= 8 * 4
    await assert_serving([b, a], "after-storage-flood")
    assert info["rss_bytes"] - before < 64 * MIB
    assert_no_crashes([a, b])


async def test_a_plain_record_cannot_squat_a_key_that_peers_sign_under(node_processes):  # noqa: F811
    a, b, c = await node_processes(3)
    key = "run/mm.7"  # a future round's matchmaking key: predictable
    squat = [DHTID.from_key(key).to_raw(), None, pack("mine"), get_dht_time() + 6 * 86400, None]
    async with WireClient(local_host=ATTACKER_HOST) as attacker:
        for node in (a, b, c):
            answer = await attacker.rpc(
                node.address, "dht.store", pack({"addr": None, "records": [squat]})
            )
            assert answer.message()["accepted"] == [True]
    stored = await a.ask({"cmd": "store", "key": key, "value": "group please", "signed": True})
    assert stored["ok"] and stored["num_accepted"] == 3, stored
    for reader in (b, c):
        found = await reader.ask({"cmd": "get", "key": key, "latest": True})
        assert found["value"] == {f"peer:{a.peer_id}": "group please"}
    assert_no_crashes([a, b, c])


class LyingNode:
    """A DHT node whose find answers name whatever ``nodes_for`` returns."""

    def __init__(self, nodes_for):
        self.identity = PeerIdentity.generate()
        self.transport = HttpTransport(self.identity, TransportConfig(host=ATTACKER_HOST))
        self._nodes_for = nodes_for
        self.num_finds = 0
        for name, handler in (("dht.ping", self._ping), ("dht.find", self._find),
                              ("dht.store", self._store)):  # fmt: skip
            self.transport.add_rpc_handler(name, handler)

    async def _ping(self, ctx, payload):
        return {"peer_id": self.identity.peer_id, "addr": self.transport.address}

    async def _find(self, ctx, payload):
        self.num_finds += 1
        return {"peer_id": self.identity.peer_id, "nodes": self._nodes_for(), "entry": None}

    async def _store(self, ctx, payload):
        accepted = [True] * len(payload.get("records", []))
        return {"peer_id": self.identity.peer_id, "accepted": accepted, "nodes": {}}


async def _black_hole() -> tuple[asyncio.Server, str]:
    """A port that accepts connections and never answers (a host that hangs)."""
    held = []

    async def hold(reader, writer):
        held.append(writer)
        await reader.read()  # until the caller gives up

    server = await asyncio.start_server(hold, ATTACKER_HOST, 0)
    return server, f"http://{ATTACKER_HOST}:{server.sockets[0].getsockname()[1]}"


def fake_nodes(count: int, address: str) -> dict[str, str]:
    return {os.urandom(32).hex(): address for _ in range(count)}


@pytest.mark.parametrize("flood", ["thousands of nodes", "unreachable nodes", "bad addresses"])
async def test_lookups_survive_answers_that_flood_them(node_processes, flood):  # noqa: F811
    dht = {"rpc_timeout_s": 1.0, "lookup_timeout_s": 3.0}
    a, b = await node_processes(2, dht=dht)
    hole, hole_address = await _black_hole()
    nodes_for = {
        "thousands of nodes": lambda: fake_nodes(5000, hole_address),
        "unreachable nodes": lambda: fake_nodes(40, hole_address),
        "bad addresses": lambda: {os.urandom(32).hex(): "ftp://1.2.3.4:21"},
    }[flood]
    liar = LyingNode(nodes_for)
    async with liar.transport:
        await liar.transport.call(a.address, "dht.ping", {"addr": liar.transport.address})
        info = await info_when(a, lambda i: liar.identity.peer_id in i["routing"])
        assert liar.identity.peer_id in info["routing"], "the liar is a node A asks"
        stored = await b.ask({"cmd": "store", "key": "honest", "value": 42, "signed": True})
        assert stored["ok"]
        lookup = await a.ask({"cmd": "lookup", "key": "anything"})
        found = await a.ask({"cmd": "get", "key": "honest", "latest": True})
    hole.close()
    assert liar.num_finds >= 1, "the liar's answer was read"
    assert "error" not in lookup, lookup
    # At most 40 nodes per answer are believed and the lookup ends at its deadline: it asks a
    # bounded number of nodes, never the thousands named.
    assert lookup["num_queried"] <= 2 + 40
    if flood == "unreachable nodes":
        assert lookup["timed_out"]
    assert found["value"] == {f"peer:{b.peer_id}": 42}
    await assert_serving([a, b], f"after-{flood.replace(' ', '-')}")
    assert_no_crashes([a, b])
