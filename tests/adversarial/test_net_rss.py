"""The victim's resident memory under the network attacks that hold its memory the longest.

Measured, not timed: each test runs one attack against a real node process and prints the
victim's RSS before, at its peak while the attack runs (polled every 50 ms) and after; the only
check is the issue's budget (at most 256 MiB over the no-attack value). Run with ``-s`` to see
the figures:

* the body pool: 64 signed requests from 8 keys announcing 4 MiB and sending nothing, and 4
  that send 4 MiB - 1 and stall (attack 1);
* the relay's byte bucket: a stranger's header-only requests to a relayed peer at about 100 a
  second plus 32 body-less signed requests held open, measured at the relay (attack 2);
* find answers: 26,000 forged records (3.9 MB; over the cap) or 8,000 (under it) in every answer
  to a reader's lookups (attack 4).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from dht.config import get_dht_time
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from dht.net.wire import pack
from tests.adversarial.harness_net import (
    WireClient,
    assert_no_crashes,
    host_port,
    http_request,
    node_processes,  # noqa: F401 - a fixture
)
from tests.adversarial.test_net_find_answers import _forged
from tests.adversarial.test_net_shares import (
    MAX_BODY,
    SECOND_ATTACKER_HOST,
    _held_bodies,
    _open_raw,
    _stranger_flood,
)
from tests.dht.net.test_transport import echo

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
BUDGET_BYTES = 256 * MIB


class PeakRss:
    """Polls a node process's RSS while a ``with`` block runs; ``before``/``peak``/``after``."""

    def __init__(self, node):
        self.node = node
        self.before = self.peak = self.after = 0
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    async def __aenter__(self) -> PeakRss:
        self.before = self.peak = await self._rss()
        self._task = asyncio.create_task(self._poll())
        return self

    async def _rss(self) -> int:
        return (await self.node.ask({"cmd": "info"}))["rss_bytes"]

    async def _poll(self) -> None:
        # never cancelled mid-ask: a question whose answer is left in the pipe would answer
        # the next one (under load the test then waited for an answer that had been read)
        while not self._stop.is_set():
            self.peak = max(self.peak, await self._rss())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._stop.wait()

    async def __aexit__(self, *exc_info) -> None:
        self._stop.set()
        await self._task
        self.peak = max(self.peak, await self._rss())

    async def settle(self, seconds: float = 2.0) -> None:
        await asyncio.sleep(seconds)
        self.after = await self._rss()

    def report(self, name: str) -> str:
        return (
            f"RSS under {name}: before {self.before / MIB:.0f} MiB, peak {self.peak / MIB:.0f} "
            f"MiB (+{(self.peak - self.before) / MIB:.0f}), after {self.after / MIB:.0f} MiB"
        )


async def test_rss_under_the_body_pool_attack(node_processes):  # noqa: F811
    victim, _ = await node_processes(2)
    async with PeakRss(victim) as rss:
        silent, _ = await _held_bodies(victim.address, 8, 8, sent_bytes=0)
        stalled, _ = await _held_bodies(victim.address, 1, 4, sent_bytes=MAX_BODY - 1)
        await asyncio.sleep(2.0)
    for writer in silent + stalled:
        writer.close()
    await rss.settle()
    print(rss.report("the body pool attack"))
    assert rss.peak - rss.before < BUDGET_BYTES
    assert_no_crashes([victim])


async def test_rss_under_the_relay_bucket_attack(node_processes, make_transport):  # noqa: F811
    (relay,) = await node_processes(1)
    hidden = await make_transport(TransportConfig(), rpc={"echo": echo})
    address = await hidden.attach_relay([relay.address])
    host, port = host_port(relay.address)
    path = f"/v2/relay/{hidden.peer_id}/v2/rpc/echo"
    forged = http_request(path, {"x-vp-peer": "0" * 64}, content_length=MAX_BODY)
    stop = asyncio.Event()
    async with PeakRss(relay) as rss:
        flood = asyncio.create_task(_stranger_flood(host, port, forged, stop))
        holders = []
        async with WireClient(local_host=SECOND_ATTACKER_HOST) as client:
            session = await client.hello(address)
            for _ in range(32):
                headers = client.sign(session, "/v2/rpc/echo", pack(1))
                request = http_request(path, headers, content_length=MAX_BODY)
                holders.append(await _open_raw(host, port, request, SECOND_ATTACKER_HOST))
            await asyncio.sleep(4.0)
        stop.set()
        await flood
    for _, writer in holders:
        writer.close()
    await rss.settle()
    print(rss.report("the relay bucket attack (at the relay)"))
    assert rss.peak - rss.before < BUDGET_BYTES
    assert_no_crashes([relay])


async def test_rss_under_the_find_answer_attack(node_processes):  # noqa: F811
    (victim,) = await node_processes(1)
    attacker = HttpTransport(PeerIdentity.generate(), TransportConfig())
    answers = {"records": []}

    async def find(ctx, request):
        return {"peer_id": attacker.peer_id, "nodes": {}, "entry": ["d", answers["records"]]}

    async def ping(ctx, request):
        return {"peer_id": attacker.peer_id, "addr": attacker.address}

    attacker.add_rpc_handler("dht.find", find)
    attacker.add_rpc_handler("dht.ping", ping)
    async with attacker, PeakRss(victim) as rss:
        for count in (26_000, 8000, 26_000, 8000):  # over the cap, and under it
            answers["records"] = _forged(count, get_dht_time() + 600)
            # a refused answer drops the attacker: introduce it again each time
            assert (await victim.ask({"cmd": "ping", "address": attacker.address}))["peer_id"]
            for _ in range(3):
                found = await victim.ask({"cmd": "get", "key": "flooded"}, 60)
                assert "error" not in found, found
    await rss.settle()
    print(rss.report("the find answer attack (26,000 and 8,000 forged records an answer)"))
    assert rss.peak - rss.before < BUDGET_BYTES
    assert_no_crashes([victim])
