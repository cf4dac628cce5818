"""The connection gate shares its open connections fairly under contention: when all are open,
a newcomer address's connection aborts the oldest of an address over its fair share. A real
server keeps serving an honest peer while two other addresses hold every connection."""

from __future__ import annotations

import asyncio

from dht.net.config import TransportConfig
from dht.net.limits import ConnectionGate
from tests.dht.net.test_connection_gate import _Server, _Transport
from tests.dht.net.test_request_shares import _echo


def _gate(max_connections: int, max_per_address: int) -> ConnectionGate:
    return ConnectionGate(max_connections=max_connections, max_per_address=max_per_address,
                          accepts_per_s_per_address=1000.0, accept_burst_per_address=1000.0,
                          contention_window_s=10.0)  # fmt: skip


async def test_a_newcomer_address_aborts_the_oldest_connection_of_one_over_its_share():
    gate, server = _gate(4, 2), _Server()
    gate.install(server)
    held = [_Transport(host) for host in ("10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.3")]
    for index, transport in enumerate(held):
        server.connection_made(index, transport)
    assert gate.num_open == 4 and not gate.admit("10.0.0.2")  # at its most
    assert gate.admit("10.0.0.1")  # holds none; the others hold 2 > 4 / 3
    newcomer = _Transport("10.0.0.1")
    server.connection_made("newcomer", newcomer)
    await asyncio.sleep(0)
    assert [t.aborted for t in held] == [True, False, False, False] and not newcomer.aborted
    assert gate.num_open == 4 and gate.open_from("10.0.0.1") == 1
    server.connection_lost(0)  # the aborted one goes: its slot was given away already
    assert gate.num_open == 4
    # 10.0.0.3 holds 2, its share of 4 / 3 rounded up: refused; 10.0.0.1 would take one from
    # an address only one ahead of it (back and forth): refused; a fourth address holding none
    # takes one from 10.0.0.3, over its share of 4 / 4
    assert not gate.admit("10.0.0.3") and not gate.admit("10.0.0.1")
    assert gate.admit("10.0.0.4")


async def _idle_connections(host: str, port: int, source: str, count: int) -> list:
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        writers.append(writer)
    return writers


async def test_a_real_server_serves_a_newcomer_while_two_addresses_hold_every_connection(
    make_transport,
):
    config = TransportConfig(max_connections=8, max_connections_per_address=4)
    node = await make_transport(config, rpc={"echo": lambda ctx, payload: _echo(payload)})
    caller = await make_transport(TransportConfig(client_mode=True))
    host, port = node.address.removeprefix("http://").rsplit(":", 1)
    writers = []
    try:
        for source in ("127.0.0.2", "127.0.0.3"):
            writers += await _idle_connections(host, int(port), source, 4)
        for _ in range(100):  # until the server set them all up
            if node.gate.num_open == 8:
                break
            await asyncio.sleep(0.01)
        assert node.gate.num_open == 8
        for _ in range(3):
            assert await caller.call(node.address, "echo", 1, timeout_s=10) == 1
        assert node.gate.open_from("127.0.0.1") >= 1
    finally:
        for writer in writers:
            writer.close()
