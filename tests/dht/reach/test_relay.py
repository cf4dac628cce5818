"""Relays between real servers on loopback: a relayed peer's server listens on 127.0.0.1 on a
port its callers never learn, so every call below goes through the relay."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from dht.errors import BadMessageError, RemoteError, TransportError
from dht.net.client import signed_headers
from dht.net.config import TransportConfig
from dht.net.schema import parse_address
from dht.net.session import digest
from dht.net.wire import pack
from dht.reach.relay_server import ATTACH_PATH, forwarded_headers
from tests.dht.net.test_transport import echo, halve, roundtrip
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


async def relayed_pair(make_transport, relay_config=None, **handlers):
    """A relay, a relayed peer (serving ``handlers``) attached to it, and a client-mode caller."""
    relay = await make_transport(relay_config or TransportConfig())
    hidden = await make_transport(TransportConfig(), **handlers)
    caller = await make_transport(TransportConfig(client_mode=True))
    address = await hidden.attach_relay([relay.address])
    return relay, hidden, caller, address


async def test_rpc_and_full_duplex_stream_through_a_relay_are_exact(make_transport):
    relay, hidden, caller, address = await relayed_pair(
        make_transport, rpc={"echo": echo}, streams={"halve": halve}
    )
    assert address == f"{relay.address}/v2/relay/{hidden.peer_id}" == hidden.address
    assert hidden.relayed and hidden.relay_url == relay.address
    assert relay.relay.relayed_peers == [hidden.peer_id]
    payload = {"blob": bytes(range(256)) * 1000, "n": [1, 2.5, None]}
    answer = await caller.call(address, "echo", payload, expected_peer=hidden.peer_id)
    assert answer == {"payload": payload, "sender": caller.peer_id}
    assert caller.peer_at(address) == hidden.peer_id  # proven end to end, through the relay
    values = np.random.default_rng(1).standard_normal(2_000_003).astype(np.float32)
    out = await roundtrip(caller, Reached(hidden, address), values)
    np.testing.assert_array_equal(out, values * np.float32(0.5))
    assert hidden.counters.per_peer[caller.peer_id].recv >= values.nbytes
    assert caller.peer_id not in relay.counters.per_peer  # the relay was no party to it
    assert relay.relay.num_relayed_bytes >= 2 * values.nbytes


class Reached:
    """``roundtrip`` takes a server object; this one names the relayed address."""

    def __init__(self, transport, address):
        self.address = address
        self.peer_id = transport.peer_id


async def test_relayed_streams_do_not_block_each_other(make_transport):
    """A stream whose reader stalls holds its own window only: another one completes."""
    _relay, hidden, caller, address = await relayed_pair(make_transport, streams={"halve": halve})
    stalled = caller.open_stream(address, "halve", {"numel": 1 << 22})
    async with stalled:
        for _ in range(4):  # 4 MiB sent, nothing read back: the stalled reply fills its windows
            await asyncio.wait_for(stalled.send(np.ones(1 << 18, np.float32)), 10)
        values = np.arange(300_000, dtype=np.float32)
        out = await roundtrip(caller, Reached(hidden, address), values)
        np.testing.assert_array_equal(out, values * np.float32(0.5))


async def test_wrong_mac_unknown_peer_and_other_paths_are_4xx_with_reason(make_transport):
    relay, _hidden, caller, address = await relayed_pair(make_transport, rpc={"echo": echo})
    await caller.call(address, "echo", 1)  # makes the session with the relayed peer
    session = await caller.sessions.get(caller._session, address, timeout_s=5, expected=None)
    body = pack(2)
    headers = signed_headers(session, caller.peer_id, "POST", "/v2/rpc/echo", digest(body))
    headers["x-vp-mac"] = "0" * 64
    async with aiohttp.ClientSession() as http:
        async with http.post(address + "/v2/rpc/echo", data=body, headers=headers) as resp:
            assert resp.status == 401 and resp.headers["x-vp-error"] == "wrong request MAC"
        unknown = f"{relay.address}/v2/relay/{'ab' * 32}/v2/rpc/echo"
        async with http.post(unknown, data=body, headers=headers) as resp:
            assert resp.status == 404 and "not relayed here" in resp.headers["x-vp-error"]
        async with http.get(address + "/metrics") as resp:
            assert resp.status == 404 and "forwards only /v2/" in resp.headers["x-vp-error"]
    with pytest.raises(RemoteError) as info:
        await caller.call(f"{relay.address}/v2/relay/{'cd' * 32}", "echo", 3)
    assert info.value.status == 404
    assert await caller.call(address, "echo", 4) == {"payload": 4, "sender": caller.peer_id}


async def test_a_peer_attaches_only_under_its_own_proven_id(make_transport):
    relay, hidden, caller, address = await relayed_pair(make_transport, rpc={"echo": echo})
    intruder = await make_transport(TransportConfig())
    session = await intruder.sessions.get(
        intruder._session, relay.address, timeout_s=5, expected=None
    )
    async with aiohttp.ClientSession() as http:
        headers = signed_headers(session, intruder.peer_id, "GET", ATTACH_PATH, digest(b""))
        headers["x-vp-peer"] = hidden.peer_id  # claims the victim's id with its own session
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await http.ws_connect(relay.address + ATTACH_PATH, headers=headers)
        assert info.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:  # no session at all
            await http.ws_connect(relay.address + ATTACH_PATH)
        assert info.value.status == 401
    assert relay.relay.relayed_peers == [hidden.peer_id]
    # attached the proper way, the intruder is listed under its own id, beside the victim
    await intruder.attach_relay([relay.address])
    assert set(relay.relay.relayed_peers) == {hidden.peer_id, intruder.peer_id}
    answer = await caller.call(address, "echo", 5, expected_peer=hidden.peer_id)
    assert answer["payload"] == 5
    third = await make_transport(TransportConfig())
    with pytest.raises(TransportError, match="it is relayed itself"):  # no chains of relays
        await third.attach_relay([hidden._local_url()])


async def test_relayed_bytes_over_the_cap_are_refused_with_503(make_transport):
    cap = 256 * 1024
    relay, _hidden, caller, address = await relayed_pair(
        make_transport,
        TransportConfig(max_relayed_bytes_per_s=cap, max_relayed_bytes_per_s_per_address=cap),
        rpc={"echo": echo},
    )
    await caller.call(address, "echo", 0)
    blob = np.random.default_rng(2).bytes(8 * cap)  # pays the bucket back in about 7 s
    big = asyncio.create_task(caller.call(address, "echo", blob, timeout_s=50))
    await wait_until(relay.relay.shares.address_rate("127.0.0.1").spent, timeout_s=30)
    with pytest.raises(RemoteError) as info:  # the same address: its own share is spent
        await caller.call(address, "echo", 1)
    assert info.value.status == 503 and "share of 262144 relayed bytes/s" in info.value.reason
    assert (await big)["payload"] == blob  # slowed to the cap, never cut


async def test_a_relay_can_be_full(make_transport):
    relay = await make_transport(TransportConfig(max_relayed_peers=1))
    first = await make_transport(TransportConfig())
    second = await make_transport(TransportConfig())
    await first.attach_relay([relay.address])
    with pytest.raises(TransportError, match="relay full"):
        await second.attach_relay([relay.address])
    assert not second.relayed and second.address != first.address


async def test_attach_fails_with_the_reasons_when_no_candidate_accepts(make_transport):
    no_relay = await make_transport(TransportConfig(relay_enabled=False))
    hidden = await make_transport(TransportConfig())
    client = await make_transport(TransportConfig(client_mode=True))
    with pytest.raises(TransportError) as info:
        await hidden.attach_relay([no_relay.address, "http://127.0.0.1:1"])
    assert "no relay accepted" in str(info.value) and "404" in str(info.value)
    with pytest.raises(TransportError, match="serves"):
        await client.attach_relay([no_relay.address])


def test_parse_address_accepts_the_relayed_form_and_nothing_else_new():
    peer = "0f" * 32
    assert parse_address(f"http://10.0.0.1:9400/v2/relay/{peer}") == (
        f"http://10.0.0.1:9400/v2/relay/{peer}"
    )
    for bad in (
        f"http://10.0.0.1:9400/v2/relay/{peer}/",
        f"http://10.0.0.1:9400/v2/relay/{peer.upper()}",
        f"http://10.0.0.1:9400/v2/relay/{peer[:-2]}",
        f"http://10.0.0.1:9400/v2/relay/{peer}/v2/relay/{peer}",
        f"http://10.0.0.1:9400/v1/relay/{peer}",
        f"http://10.0.0.1:9400/v2/relay/{peer}?x=1",
        "http://10.0.0.1:9400/v2/rpc/echo",
        "http://10.0.0.1/v2/relay/" + peer,
    ):
        with pytest.raises(BadMessageError):
            parse_address(bad)


async def test_relayed_requests_have_no_source_host_and_callers_cannot_pose_as_the_tunnel(
    make_transport,
):
    """The relayed node cannot verify where a relayed caller is (its claims get pinged back),
    and the tunnel's mark on local requests never crosses the relay from a caller."""

    async def whoami(ctx, payload):
        return ctx.remote_host

    _relay, hidden, caller, address = await relayed_pair(make_transport, rpc={"whoami": whoami})
    assert await caller.call(address, "whoami", None) == ""
    assert await caller.call(hidden._local_url(), "whoami", None) == "127.0.0.1"
    forged = {"X-VP-Tunnel": hidden.server.tunnel_token, "content-type": "x", "other": "y"}
    assert forwarded_headers(forged) == {"content-type": "x"}


async def test_a_caller_that_leaves_mid_stream_leaves_nothing_behind(make_transport):
    ended = asyncio.Event()

    async def endless(stream):
        await stream.reply({})
        try:
            while True:
                await stream.send(np.zeros(1 << 16, np.float32))
        finally:
            ended.set()

    relay, hidden, caller, address = await relayed_pair(
        make_transport, streams={"endless": endless}
    )
    for _ in range(3):
        async with caller.open_stream(address, "endless", {}) as stream:
            assert await stream.recv() is not None
        await asyncio.wait_for(ended.wait(), timeout=20)  # the handler heard the caller go
        ended.clear()
    relay_end, peer_end = relay.relay._tunnels[hidden.peer_id], hidden._tunnel._mux
    await wait_until(lambda: relay_end.num_streams == peer_end.num_streams == 0, timeout_s=20)
