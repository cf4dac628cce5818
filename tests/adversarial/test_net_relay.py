"""A relayed peer that lies in its tunnel: a real relay (a ``peer dht`` process) with an honest
relayed peer and an attacker that attaches properly (its own proven id) and then breaks the
tunnel protocol (messages too short, of unknown kinds, streams the peer may not open), which
makes the relay drop its tunnel, or answers with a made-up reply, which the caller refuses (the
relay cannot sign for anyone). The caller of the attacker gets an error, never a hang or an
answer, and the honest peer is still reached through the same relay, exactly. (Data beyond a
stream's credit is refused only once it is not read: the memory bound; tests/dht/reach/test_relay.py
holds a stalled stream.)"""

from __future__ import annotations

import asyncio
import signal
import struct

import aiohttp
import numpy as np
import pytest

from dht.errors import DHTError
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.client import signed_headers
from dht.net.config import TransportConfig
from dht.net.session import digest
from dht.net.wire import pack
from dht.reach.relay_mux import DATA, END, HEAD, MAX_MESSAGE_BYTES, OPEN, RESET
from dht.reach.relay_server import ATTACH_PATH
from tests.adversarial.harness_net import is_status_500
from tests.dht.net.test_transport import echo, halve, roundtrip
from tests.dht.reach.test_relay import Reached
from tests.dht.reach.test_relay_failover import start_relay

pytestmark = pytest.mark.timeout(120)
PREFIX = struct.Struct("<BI")


async def attach_raw(transport: HttpTransport, relay_url: str) -> aiohttp.ClientWebSocketResponse:
    """The attacker's tunnel: a correctly signed attach, then whatever it sends."""
    session = await transport.sessions.get(
        transport._session, relay_url, timeout_s=10, expected=None
    )
    headers = signed_headers(session, transport.peer_id, "GET", ATTACH_PATH, digest(b""))
    return await transport._session.ws_connect(
        relay_url + ATTACH_PATH, headers=headers, max_msg_size=MAX_MESSAGE_BYTES
    )


async def next_open(ws: aiohttp.ClientWebSocketResponse) -> int:
    """The id of the next stream the relay opens in the attacker's tunnel."""
    while True:
        message = await asyncio.wait_for(ws.receive(), timeout=20)
        assert message.type == aiohttp.WSMsgType.BINARY, message
        kind, stream_id = PREFIX.unpack_from(message.data)
        if kind == OPEN:
            return stream_id


async def closed_by_relay(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Wait until the relay closes the tunnel (what it had sent before is read past)."""
    async with asyncio.timeout(20):
        while (await ws.receive()).type == aiohttp.WSMsgType.BINARY:
            pass
    await ws.close()


async def honest_call_is_exact(caller: HttpTransport, honest: HttpTransport) -> None:
    answer = await caller.call(honest.address, "echo", "hi", expected_peer=honest.peer_id)
    assert answer == {"payload": "hi", "sender": caller.peer_id}
    values = np.random.default_rng(5).standard_normal(300_000).astype(np.float32)
    out = await roundtrip(caller, Reached(honest, honest.address), values)
    np.testing.assert_array_equal(out, values * np.float32(0.5))


@pytest.fixture
async def relay():
    process, url = await asyncio.to_thread(start_relay)
    yield process, url
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    await asyncio.to_thread(process.wait, 10)


async def test_a_lying_tunnel_is_dropped_and_the_relay_keeps_serving_the_honest(relay):
    process, relay_url = relay
    config = TransportConfig(host="127.0.0.1", port=0)
    honest = HttpTransport(PeerIdentity.generate(), config)
    honest.add_rpc_handler("echo", echo)
    honest.add_stream_handler("halve", halve)
    attacker = HttpTransport(PeerIdentity.generate(), config)
    caller = HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))
    async with honest, attacker, caller:
        await honest.attach_relay([relay_url])
        await honest_call_is_exact(caller, honest)
        attacker_address = f"{relay_url}/v2/relay/{attacker.peer_id}"
        control = pack({"s": 200, "h": {}})
        breaking = [  # each breaks the protocol: the relay closes the attacker's tunnel
            lambda sid: [b"\x03"],  # shorter than its prefix
            lambda sid: [PREFIX.pack(99, sid)],  # a kind that does not exist
            lambda sid: [PREFIX.pack(OPEN, sid + 2) + pack({"m": "GET", "p": "/", "h": {}})],
        ]
        for messages in breaking:
            ws = await attach_raw(attacker, relay_url)
            call = asyncio.create_task(caller.call(attacker_address, "echo", 1, timeout_s=20))
            stream_id = await next_open(ws)  # the caller's handshake with the attacker
            for message in messages(stream_id):
                if ws.closed:
                    break
                await ws.send_bytes(message)
            with pytest.raises(DHTError):  # refused or cut, never a hang or an answer
                await call
            await closed_by_relay(ws)
            await honest_call_is_exact(caller, honest)
        # an answer for a stream never opened is dropped; a made-up answer to the real one
        # reaches the caller, which refuses it: the relay cannot sign for the attacker's
        # session, and the attacker made no session
        ws = await attach_raw(attacker, relay_url)
        call = asyncio.create_task(caller.call(attacker_address, "echo", 1, timeout_s=20))
        stream_id = await next_open(ws)
        await ws.send_bytes(PREFIX.pack(HEAD, stream_id + 40) + control)
        await ws.send_bytes(PREFIX.pack(HEAD, stream_id) + control)
        await ws.send_bytes(PREFIX.pack(DATA, stream_id) + pack({"peer": "x" * 64}))
        await ws.send_bytes(PREFIX.pack(END, stream_id))
        with pytest.raises(DHTError):
            await call
        await ws.close()
        # the relay process lives on and still relays the honest peer exactly
        assert process.poll() is None
        await honest_call_is_exact(caller, honest)


async def test_a_relayed_end_out_of_order_is_a_502_at_once(relay):
    """The relayed end sends DATA or END before its HEAD, HEAD twice, or a RESET whose reason
    is not a map: the caller gets a 502 (or a cut answer) at once, never a 500 or a wait for
    the idle timeout (30 s), and the relay's log shows no traceback."""
    process, relay_url = relay
    config = TransportConfig(host="127.0.0.1", port=0)
    attacker = HttpTransport(PeerIdentity.generate(), config)
    caller = HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))
    head = pack({"s": 200, "h": {}})
    cases = {
        "data before head": lambda sid: [PREFIX.pack(DATA, sid) + b"x"],
        "end before head": lambda sid: [PREFIX.pack(END, sid)],
        "head twice": lambda sid: [PREFIX.pack(HEAD, sid) + head, PREFIX.pack(HEAD, sid) + head],
        "reset not a map": lambda sid: [PREFIX.pack(RESET, sid) + pack([1, 2])],
        "reset not msgpack": lambda sid: [PREFIX.pack(RESET, sid) + b"\xc1"],
    }
    async with attacker, caller:
        attacker_address = f"{relay_url}/v2/relay/{attacker.peer_id}"
        for name, messages in cases.items():
            ws = await attach_raw(attacker, relay_url)
            start = asyncio.get_running_loop().time()
            call = asyncio.create_task(caller.call(attacker_address, "echo", 1, timeout_s=20))
            stream_id = await next_open(ws)
            for message in messages(stream_id):
                await ws.send_bytes(message)
            with pytest.raises(DHTError) as info:
                await call
            assert not is_status_500(info.value), (name, info.value)
            assert asyncio.get_running_loop().time() - start < 10, name
            await ws.close()
    assert process.poll() is None
