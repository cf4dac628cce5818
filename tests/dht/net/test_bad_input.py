"""Bad input against a live node: a 4xx with a reason and one log line each; it serves on.

The requests are made by hand (:class:`tests.adversarial.harness_net.WireClient`): a proven
session, then a body that is malformed in one way.
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp
import pytest

from dht.errors import RemoteError
from dht.net.config import TransportConfig
from dht.net.refusals import HTTP_PARSER_LOGGER
from dht.net.wire import FRAME_BIN, FRAME_ERROR, FRAME_HEADER, MessageLimits, pack
from tests.adversarial.harness_net import (
    WireClient,
    host_port,
    http_request,
    raw_http,
    status_line,
)

pytestmark = pytest.mark.timeout(60)
KEY = b"swarm-key-for-tests-0123456789"


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
    # a reserved byte: an error without a message (its reason once ended in ": ", and random
    # bytes hit it about 1 time in 140)
    "a reserved byte": (b"\x8d\xc1", 400),
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


@pytest.fixture
async def client():
    async with WireClient() as wire:
        yield wire


async def still_serves(client: WireClient, node) -> None:
    answer = await client.rpc(node.address, "echo", pack({"still": "here"}))
    assert answer.status == 200
    assert answer.message() == {"still": "here"}


def refusals(caplog) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "dht.net.server" and r.levelno == logging.WARNING
    ]


@pytest.mark.parametrize("case", RPC_CASES)
async def test_bad_rpc_bodies(node, client, case, caplog):
    body, status = RPC_CASES[case]
    answer = await client.rpc(node.address, "echo", body)
    assert answer.status == status
    assert answer.reason
    assert answer.body.decode() == answer.reason
    assert len(refusals(caplog)) == 1
    await still_serves(client, node)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nope", 404),
        ("POST", "/v2/rpc/no_such_rpc", 404),
        ("GET", "/v2/rpc/echo", 405),
        ("POST", "/v2/rpc/echo", 401),  # no session
        ("POST", "/v1/rpc/echo", 426),  # the unproven protocol of before
    ],
)
async def test_bad_paths_methods_and_versions(node, client, method, path, status, caplog):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, node.address + path, data=pack(1)) as resp:
            assert resp.status == status
            assert resp.headers["x-vp-error"]
    assert len(refusals(caplog)) == 1
    await still_serves(client, node)


@pytest.mark.parametrize(
    "body",
    [os.urandom(100), FRAME_HEADER.pack(FRAME_BIN, 4) + b"abcd", FRAME_HEADER.pack(1, 10**9)],
    ids=["random bytes", "binary frame first", "frame over the limit"],
)
async def test_bad_stream_bodies(node, client, body):
    answer = await client.stream(node.address, "ok", body, header={"any": 1})
    assert answer.status == 400
    assert answer.reason
    await still_serves(client, node)


async def test_swarm_key_refusals(make_transport, caplog):
    server = await make_transport(TransportConfig(swarm_key=KEY), rpc={"echo": echo})
    async with (
        WireClient(swarm_key=KEY) as member,
        WireClient() as outsider,
        WireClient(swarm_key=b"another-key-0123456789") as stranger,
    ):
        for wire, reason in ((outsider, "missing swarm MAC"), (stranger, "wrong swarm MAC")):
            with pytest.raises(AssertionError, match=reason):
                await wire.hello(server.address)
        session = await member.hello(server.address)
        body = pack("hello")
        tampered = await member.rpc(
            server.address, "echo", pack("HELLO"), session=session, signed_body=body
        )
        assert (tampered.status, "digest" in tampered.reason) == (401, True)
        path = "/v2/rpc/echo"
        headers = member.sign(session, path, body)
        assert (await member.post(server.address + path, body, headers)).status == 200
        replayed = await member.post(server.address + path, body, headers)
        assert (replayed.status, "replayed" in replayed.reason) == (401, True)
        stale = member.sign(session, path, body)
        stale["x-vp-ts"] = f"{float(stale['x-vp-ts']) - 3600:.3f}"  # the MAC no longer matches
        assert (await member.post(server.address + path, body, stale)).status == 401
    assert server.server.num_refused == 5
    assert 1 <= len(refusals(caplog)) <= 5  # one line per status per second: floods stay short


async def test_keyed_transports_talk_and_unkeyed_ones_are_refused(make_transport):
    server = await make_transport(TransportConfig(swarm_key=KEY), rpc={"echo": echo})
    member = await make_transport(TransportConfig(swarm_key=KEY))
    outsider = await make_transport()
    assert await member.call(server.address, "echo", 5) == 5
    with pytest.raises(RemoteError) as info:
        await outsider.call(server.address, "echo", 5)
    assert info.value.status == 401


async def test_an_error_frame_first_is_a_400(node, client):
    error_first = FRAME_HEADER.pack(FRAME_ERROR, len(pack({"reason": "x"}))) + pack({"reason": "x"})
    answer = await client.stream(node.address, "ok", error_first, header={"reason": "x"})
    assert answer.status == 400 and "first frame" in answer.reason
    not_a_map = FRAME_HEADER.pack(FRAME_ERROR, 2) + b"\xc1\xc1"
    answer = await client.stream(node.address, "ok", not_a_map, header={"reason": "x"})
    assert answer.status == 400
    await still_serves(client, node)


@pytest.mark.parametrize(
    "ts", [b"\xff\xfe1700000000", b"1e10\x0b", b"1700000000\x01"], ids=["not utf-8", "vt", "soh"]
)
async def test_malformed_timestamps_are_a_4xx_with_a_printable_reason(node, client, ts, caplog):
    """Raw headers (a client library would refuse these bytes): never a 500 or a dropped
    connection, and the reason header is printable."""
    session = await client.hello(node.address)
    headers = client.sign(session, "/v2/rpc/echo", pack(1))
    headers.pop("x-vp-ts")
    host, port = host_port(node.address)
    request = http_request("/v2/rpc/echo", headers, pack(1)).replace(
        b"\r\n\r\n", b"\r\nx-vp-ts: " + ts + b"\r\n\r\n", 1
    )
    answer = await raw_http(host, port, request, read_timeout_s=5)
    assert status_line(answer) in (400, 401), answer[:300]  # the parser refuses some itself
    head = answer.split(b"\r\n\r\n", 1)[0]
    assert all(32 <= byte < 127 for line in head.split(b"\r\n") for byte in line), head
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    await still_serves(client, node)


async def test_a_header_the_parser_refuses_is_one_readable_warning(node, client, caplog):
    """aiohttp's parser refuses a control character in a header itself, and its message quotes
    the header: a '%s' in it once made the record unformattable (every handler's getMessage
    raised, and a handler that let that through turned the 400 into a 500)."""
    for limit in HTTP_PARSER_LOGGER.filters:  # one such line a second: this one is not dropped
        limit._last_s = -float("inf")
    host, port = host_port(node.address)
    request = http_request("/v2/rpc/echo", {}, pack(1)).replace(
        b"\r\n\r\n", b"\r\nx-vp-ts: \x1e%s%d\r\n\r\n", 1
    )
    answer = await raw_http(host, port, request, read_timeout_s=5)
    assert status_line(answer) == 400, answer[:300]
    (record,) = [r for r in caplog.records if r.name == HTTP_PARSER_LOGGER.name]
    assert record.levelno == logging.WARNING
    assert "400 Invalid header value char" in record.getMessage()
    assert "%s%d" in record.getMessage()
    await still_serves(client, node)


async def test_a_caller_that_hangs_up_mid_body_is_a_debug_line(node, client, caplog):
    caplog.set_level(logging.DEBUG, logger="dht.net.server")
    session = await client.hello(node.address)
    body = pack(b"x" * 1000)
    host, port = host_port(node.address)
    for _ in range(3):
        headers = client.sign(session, "/v2/rpc/echo", body)
        _, writer = await asyncio.open_connection(host, port)
        writer.write(http_request("/v2/rpc/echo", headers, body[:100], content_length=len(body)))
        await writer.drain()
        writer.close()
    for _ in range(100):  # the node notices the hang-ups
        if sum("went away" in r.getMessage() for r in caplog.records) >= 3:
            break
        await asyncio.sleep(0.02)
    assert sum("went away" in r.getMessage() for r in caplog.records) == 3
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
    await still_serves(client, node)
