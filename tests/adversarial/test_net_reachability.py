"""Dial-back as a weapon: an attacker asks a real node (a process) to dial a third party, then
floods it with dial-backs. The node dials only the attacker's own source address, at most its
burst and rate, refuses the rest with 429, and keeps serving the honest nodes."""

from __future__ import annotations

import asyncio
import errno
import time

import pytest

from dht.net.wire import pack
from tests.adversarial.harness_net import (
    ATTACKER_HOST,
    WireClient,
    assert_no_crashes,
    assert_serving,
    node_processes,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.timeout(120)
VICTIM_HOST = "127.0.0.3"
DIAL_BACK_BURST = 20  # ReachabilityConfig's defaults
RATE_PER_S = 1.0


class Listener:
    """A plain TCP listener that counts the connections made to it (and closes them)."""

    def __init__(self):
        self.num_connections = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        self.server = await asyncio.start_server(self._accept, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        writer.close()

    def close(self) -> None:
        self.server.close()


async def listeners_on_one_port() -> tuple[Listener, Listener, int]:
    """The attacker's listener and a third party's on the same port: the port the first got
    may be taken on the second address (another test's socket there), so try another."""
    for _ in range(20):
        own, victim = Listener(), Listener()
        port = await own.start(ATTACKER_HOST)
        try:
            await victim.start(VICTIM_HOST, port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            own.close()
            continue
        return own, victim, port
    raise AssertionError("no port free on both addresses in 20 tries")


async def test_dial_back_cannot_be_aimed_at_others_nor_flooded(node_processes):  # noqa: F811
    a, b = await node_processes(2)
    own, victim, port = await listeners_on_one_port()
    try:
        async with WireClient(local_host=ATTACKER_HOST) as attacker:
            session = await attacker.hello(a.address)
            # naming the host to dial is no part of the request: refused, nothing dialled
            for aimed in (
                {"port": port, "host": VICTIM_HOST},
                {"port": port, "addr": f"http://{VICTIM_HOST}"},
            ):
                answer = await attacker.rpc(a.address, "dial_back", pack(aimed), session=session)
                assert answer.status == 400 and "Extra inputs" in answer.reason, answer.reason
            # a flood: at most the burst (and what the rate adds meanwhile) is dialled
            started_s = time.monotonic()
            answers = await asyncio.gather(
                *(
                    attacker.rpc(a.address, "dial_back", pack({"port": port}), session=session)
                    for _ in range(3 * DIAL_BACK_BURST)
                )
            )
            elapsed_s = time.monotonic() - started_s
        statuses = [answer.status for answer in answers]
        served = [answer.message() for answer in answers if answer.status == 200]
        assert set(statuses) == {200, 429}, statuses
        assert DIAL_BACK_BURST <= len(served) <= DIAL_BACK_BURST + RATE_PER_S * elapsed_s + 1
        # every one went to the attacker's own address, none proved a peer there
        assert all(m == {"reachable": False, "observed_host": ATTACKER_HOST} for m in served)
        assert victim.num_connections == 0
        assert 1 <= own.num_connections <= len(served)
        # (a dial-back refused for its share empties the peer's bucket of requests: the next are
        # refused at the door, see dht/net/request_shares.py)
        assert all(x.reason.startswith(("too many dial-backs", "too many requests from this peer"))
                   for x in answers if x.status == 429)  # fmt: skip
    finally:
        own.close()
        victim.close()
    await assert_serving([a, b], "after-dial-back-flood")
    assert_no_crashes([a, b])
