"""The connection gate: open connections per source address (an IPv6 /64 counts as one) and a
share of new connections per address per second, which applies while another address is being
served. A real server refuses a sender that reconnects in a loop before a byte is parsed, and
keeps serving an honest peer from another address, on its old connection and on new ones."""

from __future__ import annotations

import asyncio

import pytest

from dht.errors import ConfigError
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from dht.net.limits import ConnectionGate
from dht.net.request_shares import RateShares
from tests.dht.net.test_request_shares import _echo

ATTACKER_HOST = "127.0.0.2"  # another loopback address: the gate tells it from 127.0.0.1


class _Transport:
    def __init__(self, host: str):
        self.host = host
        self.aborted = False

    def get_extra_info(self, name: str):
        return (self.host, 40000) if name == "peername" else None

    def abort(self) -> None:
        self.aborted = True


class _Server:  # what the gate hooks of aiohttp's web.Server
    def connection_made(self, handler, transport) -> None:
        pass

    def connection_lost(self, handler, exc=None) -> None:
        pass


def _gate(*, max_per_address=100, burst=100.0, requests=None) -> ConnectionGate:
    # refills slow enough that a loaded machine sees one burst
    return ConnectionGate(max_connections=1000, max_per_address=max_per_address,
                          accepts_per_s_per_address=0.01, accept_burst_per_address=burst,
                          contention_window_s=10.0, requests=requests)  # fmt: skip


async def test_open_connections_are_counted_per_ipv6_slash_64():
    gate, server = _gate(max_per_address=2), _Server()
    gate.install(server)
    transports = [_Transport(f"2001:db8:0:1::{i}") for i in range(1, 4)]
    for index, transport in enumerate(transports):
        server.connection_made(index, transport)
    await asyncio.sleep(0)  # (the refused one is aborted on the next turn of the loop)
    assert [t.aborted for t in transports] == [False, False, True]
    assert gate.open_from("2001:db8:0:1::ffff") == 2 and gate.num_refused == 1
    other = _Transport("2001:db8:0:2::1")  # another /64
    server.connection_made("other", other)
    server.connection_lost(0)
    server.connection_made("again", _Transport("2001:db8:0:1::9"))
    await asyncio.sleep(0)
    assert not other.aborted and gate.num_open == 3 and gate.num_refused == 1


def test_an_address_alone_opens_as_many_as_it_likes_and_a_contended_one_gets_its_share():
    gate = _gate(burst=3)
    assert all(gate.admit("10.0.0.1") for _ in range(10))  # alone: never refused for its rate
    assert gate.admit("10.0.0.2")  # another address connected: both are contended now
    assert [gate.admit("10.0.0.1") for _ in range(2)] == [False, False]  # its burst is spent
    assert [gate.admit("10.0.0.2") for _ in range(3)] == [True, True, False]
    assert gate.num_refused_for_rate == 3


def test_another_address_served_requests_makes_the_accept_share_apply():
    requests = RateShares(rate_per_s=1, burst=1, max_hold_s=1.0, holder="address",
                          contention_window_s=10.0)  # fmt: skip
    gate = _gate(burst=2, requests=requests)
    assert requests.take("10.0.0.9") is None  # (its connection is old: not among the accepts)
    assert [gate.admit("10.0.0.1") for _ in range(3)] == [True, True, False]


def test_config_refuses_an_accept_share_that_is_not_positive():
    for name in ("max_connection_accepts_per_s_per_address", "connection_accept_burst_per_address"):
        with pytest.raises(ConfigError, match=name):
            TransportConfig(**{name: 0})


async def _fresh_connection_info(host: str, port: int, source: str) -> bytes:
    """A new connection from ``source`` that asks for ``/v2/info`` and hangs up: what came back
    (b"" when the node closed it first)."""
    try:
        reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    except OSError:
        return b""
    try:
        writer.write(b"GET /v2/info HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()
    except OSError:  # reset by the node
        return b""
    finally:
        writer.close()


async def assert_a_reconnecting_sender_gets_its_burst(node, honest) -> None:
    """40 fresh connections from the attacker's address to a node whose share of accepts per
    address is a burst of 20 (and a rate that refills none meanwhile): 20 served, 20 refused;
    the honest peer at 127.0.0.1 is served before and after."""
    assert await honest.call(node.address, "echo", 1) == 1  # 127.0.0.1 is being served
    host, port = node.address.removeprefix("http://").rsplit(":", 1)
    answers = [await _fresh_connection_info(host, int(port), ATTACKER_HOST) for _ in range(40)]
    served = [a for a in answers if a.startswith(b"HTTP/1.1 200")]
    assert len(served) == 20 and answers.count(b"") == 20, answers
    assert node.gate.num_refused_for_rate == 20
    assert await honest.call(node.address, "echo", 2) == 2


async def test_a_real_server_refuses_a_sender_that_reconnects_and_serves_the_honest(
    make_transport,
):
    config = TransportConfig(max_connection_accepts_per_s_per_address=0.05,
                             connection_accept_burst_per_address=20)  # fmt: skip
    node = await make_transport(config)
    node.add_rpc_handler("echo", lambda ctx, payload: _echo(payload))
    honest = await make_transport(TransportConfig(client_mode=True))
    await assert_a_reconnecting_sender_gets_its_burst(node, honest)
    # the honest peer is served on new connections too (a fresh client: its address
    # has a share of new connections of its own, far from spent)
    assert await honest.call(node.address, "echo", 2) == 2
    async with HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True)) as new:
        assert await asyncio.gather(*(new.call(node.address, "echo", i) for i in range(8))) == (
            list(range(8))
        )
    assert node.gate.num_refused_for_rate == 20


async def test_a_server_on_ipv6_loopback_serves_and_gates(make_transport):
    config = TransportConfig(host="::1", max_connection_accepts_per_s_per_address=0.05,
                             connection_accept_burst_per_address=2)  # fmt: skip
    node = await make_transport(config)
    node.add_rpc_handler("echo", lambda ctx, payload: _echo(payload))
    assert node.address.startswith("http://[::1]:")
    client = await make_transport(TransportConfig(client_mode=True))
    assert await client.call(node.address, "echo", 1) == 1
    assert node.gate.open_from("::1") >= 1 and node.gate.num_refused == 0
