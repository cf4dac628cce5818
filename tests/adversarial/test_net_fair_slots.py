"""Addresses that together fill a relayed peer's request slots: honest callers still get theirs.

A relay, a peer reached only through it, and an honest node run in their own processes. Three
attacker addresses (``127.0.0.2`` to ``127.0.0.4``) each keep ``NUM_HELD`` signed requests to the
relayed peer open through the relay, announcing a body they never send (the relayed peer times
each out after ``body_stall_timeout_s``, and the attacker sends the next at once): each address
alone stays within its fixed share of the peer's slots (8 of 16), and together they hold all
16. The relay shares its slots fairly under contention (:class:`dht.net.shares.FairSlots`): the
honest node's address, holding none, takes one from an address over its fair share, so every
honest ping through the relay is answered, and the attackers are refused (429) past their share.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from aiohttp import WSMsgType

from dht.net.config import TransportConfig
from dht.net.wire import pack
from tests.adversarial.harness_net import (
    WireClient,
    assert_no_crashes,
    assert_serving,
    host_port,
    http_request,
    node_processes,  # noqa: F401 - a fixture
    status_line,
)
from tests.adversarial.test_net_shares import _attach, _open_raw

pytestmark = pytest.mark.timeout(120)
ATTACKER_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NUM_HELD = 10  # requests each attacker address keeps open: past its fixed share of 8
NUM_PINGS = 30
PING_PAUSE_S = 0.1
DEFAULTS = TransportConfig()
ANSWER_TIMEOUT_S = 2 * DEFAULTS.body_stall_timeout_s + 5  # the relayed peer answers by then


class SlotHolder:
    """One attacker address keeping ``NUM_HELD`` body-less signed requests open to a relayed
    peer through its relay, each answered one sent again at once; every status kept."""

    def __init__(self, source: str, address: str, peer_id: str):
        self.source = source
        self.host, self.port = host_port(address.split("/v2/relay/")[0])
        self.address = address
        self.path = f"/v2/relay/{peer_id}/v2/rpc/dht.ping"
        self.statuses: list[int] = []
        self.evicted = 0  # its requests cut (429) for an address holding fewer slots
        self._client = WireClient(local_host=source)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self._client.__aenter__()
        session = await self._client.hello(self.address)
        self._tasks = [asyncio.create_task(self._hold(session)) for _ in range(NUM_HELD)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.__aexit__()

    async def _hold(self, session) -> None:
        body = pack({"addr": None})
        while True:
            headers = self._client.sign(session, "/v2/rpc/dht.ping", body)
            request = http_request(self.path, headers, content_length=len(body))
            try:
                reader, writer = await _open_raw(self.host, self.port, request, self.source)
            except OSError:  # past its address's share of new connections: it comes back
                await asyncio.sleep(0.05)
                continue
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT_S):
                    head = await reader.read(1024)
                self.statuses.append(status_line(head))
                self.evicted += b"was given to another address" in head
            finally:
                writer.close()
            await asyncio.sleep(0.01)  # (a 429's hold already paces one that ignores it)


async def test_addresses_that_fill_a_relayed_peers_slots_leave_honest_callers_theirs(
    node_processes,  # noqa: F811
):
    (relay,) = await node_processes(1)
    (victim,) = await node_processes(1, initial_peers=[relay.address], relay_urls=[relay.address])
    (honest,) = await node_processes(1, initial_peers=[relay.address])
    assert victim.address == f"{relay.address}/v2/relay/{victim.peer_id}", victim.address
    holders = [SlotHolder(source, victim.address, victim.peer_id) for source in ATTACKER_HOSTS]
    try:
        for holder in holders:
            await holder.start()
        # each address is refused past its own fixed share: together they hold every slot
        for _ in range(200):
            if all(429 in holder.statuses for holder in holders[:2]):
                break
            await asyncio.sleep(0.05)
        latencies = []
        for _ in range(NUM_PINGS):
            answer = await honest.ask({"cmd": "pings", "address": victim.address, "count": 1})
            latencies += answer["latencies_s"]
            await asyncio.sleep(PING_PAUSE_S)
    finally:
        for holder in holders:
            await holder.stop()
    statuses = {holder.source: Counter(holder.statuses) for holder in holders}
    num_evicted = sum(holder.evicted for holder in holders)
    print(f"fair slots: honest pings {sum(x is not None for x in latencies)}/{NUM_PINGS} "
          f"answered; attackers' answers {statuses}, {num_evicted} of their requests cut "
          "for an address holding fewer")  # fmt: skip
    assert num_evicted >= 1  # the pool was full: slots changed hands, never past capacity
    assert None not in latencies, (latencies, statuses)
    for source, counts in statuses.items():
        assert counts[429] > 0, (source, counts)
        # refused (429), or timed out by the relayed peer (408; 502 once the tunnel stream is
        # reset), never served: they never send the body they announce
        assert set(counts) <= {429, 408, 502}, (source, counts)
    await assert_serving([relay, honest], "fair-slots")
    assert_no_crashes([relay, victim, honest])


async def _closed_soon(ws: aiohttp.ClientWebSocketResponse, timeout_s: float = 1.0) -> bool:
    """Whether the relay closes this tunnel within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            message = await ws.receive()
    except TimeoutError:
        return False
    return message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def test_addresses_that_fill_a_relays_seats_leave_a_newcomer_one(node_processes):  # noqa: F811
    """Two addresses with fresh keys take the relay's 8 seats (4 each, their fixed share): a
    newcomer address still attaches, in a seat taken from an address over its fair share (that
    tunnel is closed), and the attackers are refused past their share."""
    (relay,) = await node_processes(
        1, transport={"max_relayed_peers": 8, "max_relayed_peers_per_address": 4}
    )
    sybils = [WireClient(local_host=host) for host in ATTACKER_HOSTS[:2] for _ in range(5)]
    for sybil in sybils:
        await sybil.__aenter__()
    try:
        statuses = [await _attach(sybil, relay.address) for sybil in sybils]
        assert statuses.count(101) == 8 and statuses.count(503) == 2, statuses
        async with WireClient() as newcomer:
            assert await _attach(newcomer, relay.address) == 101
            attached = [s for s in sybils if getattr(s, "tunnel", None) is not None]
            # one attacker's tunnel was closed for the newcomer's seat
            closed = await asyncio.gather(*(_closed_soon(s.tunnel) for s in attached))
            assert closed.count(True) == 1, closed
            closed = [s for s, is_closed in zip(attached, closed, strict=True) if is_closed]
            async with WireClient(local_host=closed[0]._local_host) as again:
                assert await _attach(again, relay.address) == 503  # it holds its share
    finally:
        for sybil in sybils:
            await sybil.__aexit__()
    assert_no_crashes([relay])
