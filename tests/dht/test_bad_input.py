"""Bad input against a live node: a 4xx with a reason and one log line each; it serves on."""

from __future__ import annotations

import logging
import os

import aiohttp
import msgpack
import pytest

from dht.auth import SwarmAuth, body_digest
from dht.http_config import TransportConfig
from dht.identity import PeerIdentity
from dht.wire import FRAME_BIN, FRAME_HEADER, MessageLimits, pack

pytestmark = pytest.mark.timeout(60)
KEY = b"swarm-key-for-tests-0123456789"
SENDER = PeerIdentity.generate().peer_id


async def echo(ctx, payload):
    return payload


async def ok_stream(stream):
    await stream.reply({"ok": True})
    async for _ in stream:
        pass


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # fixarray of one element, depth times


RPC_CASES = {
    "random bytes": (os.urandom(64), 400),
    "truncated msgpack": (pack({"key": "x" * 50})[:-10], 400),
    "deeply nested msgpack": (nested(500), 400),
    "trailing garbage": (pack(1) + b"\x00", 400),
    "body over the limit": (pack(b"x" * (70 * 1024)), 413),
}


@pytest.fixture
async def node(make_transport):
    limits = MessageLimits(max_body_bytes=64 * 1024, max_msgpack_depth=8)
    return await make_transport(
        TransportConfig(limits=limits), rpc={"echo": echo}, streams={"ok": ok_stream}
    )


async def still_serves(session, node) -> None:
    body = pack({"still": "here"})
    async with session.post(
        f"{node.address}/v1/rpc/echo", data=body, headers={"x-vp-peer": SENDER}
    ) as resp:
        assert resp.status == 200
        assert msgpack.unpackb(await resp.read()) == {"still": "here"}


def refusals(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "dht.http" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("case", RPC_CASES)
async def test_bad_rpc_bodies(node, case, caplog):
    body, status = RPC_CASES[case]
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{node.address}/v1/rpc/echo", data=body, headers={"x-vp-peer": SENDER}
        ) as resp:
            assert resp.status == status
            assert resp.headers["x-vp-error"]
            assert await resp.text() == resp.headers["x-vp-error"]
        assert len(refusals(caplog)) == 1
        await still_serves(session, node)


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/nope", {}, 404),
        ("POST", "/v1/rpc/no_such_rpc", {"x-vp-peer": SENDER}, 404),
        ("GET", "/v1/rpc/echo", {}, 405),
        ("POST", "/v1/rpc/echo", {}, 400),  # no sender id
        ("POST", "/v1/rpc/echo", {"x-vp-peer": "not-a-peer-id"}, 400),
    ],
)
async def test_bad_paths_methods_and_headers(node, method, path, headers, status, caplog):
    async with aiohttp.ClientSession() as session:
        async with session.request(
            method, node.address + path, data=pack(1), headers=headers
        ) as resp:
            assert resp.status == status
            assert resp.headers["x-vp-error"]
        assert len(refusals(caplog)) == 1
        await still_serves(session, node)


@pytest.mark.parametrize(
    "body",
    [os.urandom(100), FRAME_HEADER.pack(FRAME_BIN, 4) + b"abcd", FRAME_HEADER.pack(1, 10**9)],
    ids=["random bytes", "binary frame first", "frame over the limit"],
)
async def test_bad_stream_bodies(node, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{node.address}/v1/stream/ok", data=body, headers={"x-vp-peer": SENDER}
        ) as resp:
            assert resp.status == 400
            assert resp.headers["x-vp-error"]
        await still_serves(session, node)


async def test_swarm_mac_refusals(make_transport, caplog):
    server = await make_transport(TransportConfig(swarm_key=KEY), rpc={"echo": echo})
    url, path = f"{server.address}/v1/rpc/echo", "/v1/rpc/echo"
    body = pack("hello")
    good = {
        "x-vp-peer": SENDER,
        **SwarmAuth(KEY).sign_request("POST", path, body_digest(body), SENDER),
    }
    wrong = {
        "x-vp-peer": SENDER,
        **SwarmAuth(b"another-key-0123456789").sign_request(
            "POST", path, body_digest(body), SENDER
        ),
    }
    stale_auth = SwarmAuth(KEY)
    stale = {
        "x-vp-peer": SENDER,
        **stale_auth.sign_request("POST", path, body_digest(body), SENDER),
    }
    stale["x-vp-ts"] = f"{float(stale['x-vp-ts']) - 3600:.3f}"
    tampered_body = pack("HELLO")
    async with aiohttp.ClientSession() as session:

        async def post(headers, data=body):
            async with session.post(url, data=data, headers=headers) as resp:
                return resp.status, resp.headers.get("x-vp-error", "")

        assert await post({"x-vp-peer": SENDER}) == (401, "missing swarm MAC")
        assert await post(wrong) == (401, "wrong swarm MAC")
        assert (await post(stale))[0] == 401  # the MAC no longer matches the changed timestamp
        assert await post(good, data=tampered_body) == (401, "wrong swarm MAC")
        assert await post(good) == (200, "")
        status, reason = await post(good)  # the same request again: a replay
        assert (status, "replayed" in reason) == (401, True)
        assert len(refusals(caplog)) == 5

    # a correctly signed request from too long ago (the sender's clock is an hour behind)
    old = SwarmAuth(KEY)
    old_headers = old.sign_request("POST", path, body_digest(body), SENDER)
    ts = f"{float(old_headers['x-vp-ts']) - 3600:.3f}"
    old_headers["x-vp-ts"] = ts
    old_headers["x-vp-mac"] = old._mac(
        b"POST",
        path.encode(),
        body_digest(body),
        SENDER.encode(),
        ts.encode(),
        old_headers["x-vp-nonce"].encode(),
    ).hex()
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=body, headers={"x-vp-peer": SENDER, **old_headers}) as r:
            assert r.status == 401 and "stale" in r.headers["x-vp-error"]


async def test_keyed_transports_talk_and_unkeyed_ones_are_refused(make_transport):
    from dht.errors import RemoteError

    server = await make_transport(TransportConfig(swarm_key=KEY), rpc={"echo": echo})
    member = await make_transport(TransportConfig(swarm_key=KEY))
    outsider = await make_transport()
    assert await member.call(server.address, "echo", 5) == 5
    with pytest.raises(RemoteError) as info:
        await outsider.call(server.address, "echo", 5)
    assert info.value.status == 401
