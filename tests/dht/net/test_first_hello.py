"""A hello that rides on the first request, between real servers on loopback.

The paths each server was asked for are counted by a middleware in front of its own, so "no
separate handshake" is a count of requests, not a time.
"""

from __future__ import annotations

import base64
import sys

import aiohttp
import msgpack
import pytest
from aiohttp import web

from dht.errors import WrongPeerError
from dht.identity import PeerIdentity
from dht.net.auth import SwarmAuth
from dht.net.client import HELLO_HEADER, HELLO_PATH, HELLO_REPLY_HEADER, encode_hello_header
from dht.net.config import TransportConfig
from dht.net.server import HttpServer
from dht.net.session import FirstRequest, PendingHello, digest
from dht.net.wire import pack

pytestmark = pytest.mark.timeout(60)
KEY = b"swarm-key-for-tests-0123456789"
ECHO_PATH = "/v2/rpc/echo"


@pytest.fixture
def paths(monkeypatch) -> dict[str, list[str]]:
    """Every request path each server (by peer id) was asked for, as it arrived."""
    seen: dict[str, list[str]] = {}
    application = HttpServer.application

    def counted(self: HttpServer) -> web.Application:
        app = application(self)

        @web.middleware
        async def count(request: web.Request, handler):
            seen.setdefault(self.peer_id, []).append(request.path)
            return await handler(request)

        app.middlewares.insert(0, count)
        return app

    monkeypatch.setattr(HttpServer, "application", counted)
    return seen


async def pair(make_transport, swarm_key=None):
    calls: list[object] = []

    async def echo(ctx, payload):
        calls.append(payload)
        return {"payload": payload, "sender": ctx.sender}

    config = TransportConfig(swarm_key=swarm_key)
    server = await make_transport(config, rpc={"echo": echo})
    client = await make_transport(config)
    return server, client, calls


def first_request(
    identity: PeerIdentity, to: str, body: bytes, *, path: str = ECHO_PATH, swarm_key=None
) -> dict[str, str]:
    """The headers of a first request with its hello, as an honest caller makes them."""
    hello = PendingHello(identity, FirstRequest(to, "POST", path, digest(body)))
    wire = encode_hello_header(hello.request.to_wire())
    headers = {
        "content-type": "application/msgpack",
        "x-vp-peer": identity.peer_id,
        "x-vp-digest": digest(body).hex(),
        HELLO_HEADER: wire,
    }
    if swarm_key is not None:
        headers["x-vp-mac"] = SwarmAuth(swarm_key).hello_mac(wire.encode("ascii"))
    return headers


async def post(
    address: str, body: bytes, headers: dict, path: str = ECHO_PATH, local_host: str | None = None
):
    connector = aiohttp.TCPConnector(local_addr=(local_host, 0) if local_host else None)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.post(address + path, data=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()


@pytest.mark.parametrize("swarm_key", [None, KEY])
async def test_first_rpc_carries_its_hello_and_later_ones_reuse_the_session(
    make_transport, paths, swarm_key
):
    server, client, calls = await pair(make_transport, swarm_key)
    for index in range(3):
        answer = await client.call(
            server.address, "echo", {"i": index}, expected_peer=server.peer_id
        )
        assert answer == {"payload": {"i": index}, "sender": client.peer_id}
    assert paths[server.peer_id] == [ECHO_PATH] * 3  # no POST /v2/hello at all
    assert client.sessions.num_handshakes == 0 and client.sessions.num_first_hellos == 1
    assert server.server.num_first_hellos == 1 and server.server.num_hellos == 0
    assert client.peer_at(server.address) == server.peer_id
    assert server.hello_seen_since(client.peer_id, 0.0)
    assert len(calls) == 3


async def test_a_node_known_only_by_address_gets_a_separate_hello(make_transport, paths):
    server, client, _ = await pair(make_transport)
    await client.call(server.address, "echo", 1)  # no expected peer: nothing to sign it for
    await client.call(server.address, "echo", 2, expected_peer=server.peer_id)
    assert paths[server.peer_id] == [HELLO_PATH, ECHO_PATH, ECHO_PATH]
    assert client.sessions.num_first_hellos == 0 and client.sessions.num_handshakes == 1


async def test_another_peer_at_the_address_refuses_the_hello_meant_for_the_old(
    make_transport, paths
):
    server, client, calls = await pair(make_transport)
    gone = PeerIdentity.generate().peer_id  # the peer the caller believes is there
    with pytest.raises(WrongPeerError) as caught:
        await client.call(server.address, "echo", 1, expected_peer=gone)
    assert caught.value.actual == server.peer_id  # proven by the separate handshake
    assert paths[server.peer_id] == [ECHO_PATH, HELLO_PATH]  # refused at the door, then hello
    assert calls == []  # the request meant for another peer was not served


def _forgeries(server_id: str, body: bytes) -> dict[str, dict[str, str]]:
    honest = PeerIdentity.generate()
    thief = PeerIdentity.generate()
    other_node = PeerIdentity.generate().peer_id
    signed_by_thief = first_request(thief, server_id, body)
    # the thief's signature under the honest peer's name
    hello = msgpack.unpackb(base64.urlsafe_b64decode(signed_by_thief[HELLO_HEADER]))
    hello["peer"] = honest.peer_id
    under_another_name = dict(signed_by_thief, **{HELLO_HEADER: encode_hello_header(hello)})
    return {
        "signature of another key": under_another_name,
        "meant for another node": first_request(honest, other_node, body),
        "signed for another path": first_request(honest, server_id, body, path="/v2/rpc/ping"),
        "signed for another body": first_request(honest, server_id, body + b"\x00"),
        "not base64": dict(first_request(honest, server_id, body), **{HELLO_HEADER: "%%%"}),
        "not a hello": dict(
            first_request(honest, server_id, body), **{HELLO_HEADER: encode_hello_header({})}
        ),
        "x-vp-peer another than the hello's": dict(
            first_request(honest, server_id, body), **{"x-vp-peer": thief.peer_id}
        ),
        "digest header missing": {
            k: v for k, v in first_request(honest, server_id, body).items() if k != "x-vp-digest"
        },
    }


async def test_forged_or_mismatched_hellos_are_refused_and_the_node_keeps_serving(
    make_transport,
):
    server, client, calls = await pair(make_transport)
    body = pack({"store": "me"})
    for what, headers in _forgeries(server.peer_id, body).items():
        status, answer_headers, _ = await post(server.address, body, headers)
        assert 400 <= status < 500, what
        assert answer_headers.get("x-vp-error"), what
        assert HELLO_REPLY_HEADER not in answer_headers, what
    assert calls == []
    assert await client.call(server.address, "echo", 1, expected_peer=server.peer_id)
    assert len(calls) == 1


async def test_a_replayed_first_request_is_refused(make_transport):
    server, _, calls = await pair(make_transport)
    body = pack({"store": "once"})
    headers = first_request(PeerIdentity.generate(), server.peer_id, body)
    status, first_headers, _ = await post(server.address, body, headers)
    assert status == 200 and HELLO_REPLY_HEADER in first_headers
    status, answer_headers, _ = await post(server.address, body, headers)
    assert status == 401 and "replayed" in answer_headers["x-vp-error"]
    assert len(calls) == 1  # served once


async def test_a_first_request_without_the_swarm_key_is_refused(make_transport):
    server, _, calls = await pair(make_transport, KEY)
    body = pack(1)
    outsider = first_request(PeerIdentity.generate(), server.peer_id, body)  # no swarm MAC
    wrong_key = first_request(
        PeerIdentity.generate(), server.peer_id, body, swarm_key=b"another-swarm-key-0123456789"
    )
    for headers in (outsider, wrong_key):
        status, answer_headers, _ = await post(server.address, body, headers)
        assert status == 401 and "swarm MAC" in answer_headers["x-vp-error"]
    member = first_request(PeerIdentity.generate(), server.peer_id, body, swarm_key=KEY)
    status, _, _ = await post(server.address, body, member)
    assert status == 200 and len(calls) == 1


async def test_first_requests_count_as_handshakes_of_their_address(make_transport):
    config = TransportConfig(max_handshakes_per_s_per_address=0.01, handshake_burst=2)
    server = await make_transport(config, rpc={"echo": lambda ctx, payload: _echo(payload)})
    body = pack(1)
    statuses = []
    for _ in range(4):
        headers = first_request(PeerIdentity.generate(), server.peer_id, body)
        statuses.append((await post(server.address, body, headers))[0])
    assert statuses == [200, 200, 429, 429]


async def _echo(payload):
    return payload


async def test_a_relayed_node_gets_the_hello_on_the_first_request_too(make_transport, paths):
    relay = await make_transport()
    server, client, calls = await pair(make_transport)
    relayed = await server.attach_relay([relay.address])
    for index in range(2):
        answer = await client.call(relayed, "echo", index, expected_peer=server.peer_id)
        assert answer == {"payload": index, "sender": client.peer_id}
    assert paths[server.peer_id].count(ECHO_PATH) == 2  # (its tunnel's requests come here too)
    assert HELLO_PATH not in paths[server.peer_id]
    assert client.sessions.num_handshakes == 0 and client.sessions.num_first_hellos == 1
    assert relay.server.hellos.num_refused == 0 and len(calls) == 2


async def test_a_relay_counts_first_requests_as_handshakes_of_their_address(make_transport):
    # a burst of 2: the relayed node's own attach, then one first request through the relay
    relay = await make_transport(
        TransportConfig(max_handshakes_per_s_per_address=0.01, handshake_burst=2)
    )
    server, _, calls = await pair(make_transport)
    relayed = await server.attach_relay([relay.address])
    body = pack(1)
    statuses = []
    for _ in range(2):
        headers = first_request(PeerIdentity.generate(), server.peer_id, body)
        statuses.append((await post(relayed, body, headers))[0])
    assert statuses == [200, 429] and len(calls) == 1


class _SkewedClock:
    """``time`` with the caller's wall clock 100 s ahead: in :mod:`dht.net.client` (all of it
    the caller's) or, with ``callers``, only for calls from functions of those names (in
    :mod:`dht.net.session`, ``PendingHello``'s; the node's ``check_hello`` and
    ``answer_with_key`` read the true clock)."""

    def __init__(self, real, callers: tuple[str, ...] | None = None):
        self._real = real
        self._callers = callers

    def time(self) -> float:
        caller = sys._getframe(1).f_code.co_name
        skewed = self._callers is None or caller in self._callers
        return self._real.time() + (100.0 if skewed else 0.0)

    def monotonic(self) -> float:
        return self._real.monotonic()


async def test_a_clock_outside_the_replay_window_falls_back_to_a_separate_hello(
    make_transport, paths, monkeypatch
):
    import dht.net.client as client_module
    import dht.net.session as session_module

    server, client, calls = await pair(make_transport)
    # the caller's clock 100 s ahead: its first request's timestamp is outside the node's 30-s
    # replay window
    real = session_module.time
    monkeypatch.setattr(session_module, "time", _SkewedClock(real, ("__init__", "finish")))
    monkeypatch.setattr(client_module, "time", _SkewedClock(real))
    answer = await client.call(server.address, "echo", 1, expected_peer=server.peer_id)
    assert answer == {"payload": 1, "sender": client.peer_id}
    assert paths[server.peer_id] == [ECHO_PATH, HELLO_PATH, ECHO_PATH]
    assert server.server.num_first_hellos == 0 and len(calls) == 1
    # the handshake told the caller the nodes' clock: its next first contact is one request
    other, _, _ = await pair(make_transport)
    await client.call(other.address, "echo", 2, expected_peer=other.peer_id)
    assert paths[other.peer_id] == [ECHO_PATH] and other.server.num_first_hellos == 1


async def test_a_first_requests_body_is_charged_to_its_address_as_any_requests(make_transport):
    """The bytes of a first request's body count against its address's share of requests, as
    a later request's do (one key cannot send big bodies for free by always being new)."""
    config = TransportConfig(
        max_requests_per_s_per_address=0.01, request_burst_per_address=10,
        request_body_bytes_per_request=1000, handshake_burst=10,
    )  # fmt: skip
    server = await make_transport(config, rpc={"echo": lambda ctx, payload: _echo(payload)})
    big, small = pack(b"x" * 8500), pack(1)
    # another address in the contention window: the address shares apply
    other = first_request(PeerIdentity.generate(), server.peer_id, small)
    assert (await post(server.address, small, other, local_host="127.0.0.2"))[0] == 200
    headers = first_request(PeerIdentity.generate(), server.peer_id, big)
    assert (await post(server.address, big, headers))[0] == 200  # 1 request + 8.5 of body
    headers = first_request(PeerIdentity.generate(), server.peer_id, small)
    status, answer_headers, _ = await post(server.address, small, headers)
    assert status == 429 and int(answer_headers["Retry-After"]) >= 1
