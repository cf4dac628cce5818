"""A node keeps the connections it opened for ``client_keepalive_s`` and closes them itself
before the other side's idle timeout: requests in between share one connection."""

from __future__ import annotations

import asyncio

import pytest

from dht.net.config import TransportConfig
from tests.dht.net.test_request_shares import _echo

pytestmark = pytest.mark.timeout(30)


async def _num_open_becomes(node, wanted: int, timeout_s: float = 10.0) -> int:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if node.gate.num_open == wanted:
            break
        await asyncio.sleep(0.02)
    return node.gate.num_open


async def test_requests_within_the_keepalive_share_a_connection_the_client_then_closes(
    make_transport,
):
    node = await make_transport(TransportConfig())
    node.add_rpc_handler("echo", lambda ctx, payload: _echo(payload))
    client = await make_transport(TransportConfig(client_mode=True, client_keepalive_s=1.0))
    for i in range(5):
        assert await client.call(node.address, "echo", i) == i
        await asyncio.sleep(0.1)
    assert node.gate.num_open == 1  # one connection, kept between the requests
    # idle for its keepalive: closed by the client, long before the server's 30 s
    assert await _num_open_becomes(node, 0) == 0
    assert await client.call(node.address, "echo", 9) == 9
    assert await _num_open_becomes(node, 1) == 1


def test_the_default_keepalive_ends_before_the_default_idle_timeout():
    config = TransportConfig()
    assert 15.0 < config.client_keepalive_s < config.idle_connection_timeout_s
