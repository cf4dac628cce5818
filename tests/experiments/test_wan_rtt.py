"""Measured RTT (the metrics stream's ``net.rtt_ms``): the transport times its small requests;
per interval, the median over peers of the fastest round trip to each. Checked against an
emulated link of known RTT (real aiohttp transports in two namespaces)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from pyroute2 import netns

from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from dht.net.transport import ByteCounters
from experiments.linkemu.fidelity import ADDRESS_B, EmulatedPair
from experiments.linkemu.shaper import LinkShape

pytestmark = pytest.mark.timeout(120)
NEEDS_TAP = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/net/tun"),
    reason="TAP devices need root and /dev/net/tun",
)


def test_the_median_is_over_peers_of_each_ones_fastest_request():
    counters = ByteCounters()
    counters.add_rtt("old", 9.0)
    since_s = time.monotonic()
    for peer, rtts in {"a": [0.5, 0.01], "b": [0.02, 0.2], "c": [0.03]}.items():
        for rtt_s in rtts:
            counters.add_rtt(peer, rtt_s)
    assert counters.median_rtt_s(since_s) == pytest.approx(0.02)
    assert counters.median_rtt_s(time.monotonic()) is None


async def _echo(ctx, payload):
    return payload


async def _held(ctx, payload):
    await asyncio.sleep(0.3)  # a server that waits before answering, as a matchmaking leader
    return payload


def _in_namespaces(pair: EmulatedPair) -> float | None:
    async def main() -> float | None:
        netns.setns(pair.b, flags=0)  # the server listens in b ...
        server = HttpTransport(PeerIdentity.generate(), TransportConfig(host=ADDRESS_B))
        server.add_rpc_handler("echo", _echo)
        server.add_rpc_handler("held", _held)
        await server.start()
        netns.setns(pair.a, flags=0)  # ... and the client's sockets live in a
        client = HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))
        try:
            await client.start()
            await client.call(server.address, "echo", 0)  # connection set up before timing
            since_s = time.monotonic()
            for number in range(20):
                await client.call(server.address, "held" if number % 4 else "echo", number)
            await client.call(server.address, "echo", bytes(64 * 1024))  # too big to time
            return client.counters.median_rtt_s(since_s)
        finally:
            await client.close()
            await server.close()

    out: list = []

    def target() -> None:
        try:
            out.append(asyncio.run(main()))
        except BaseException as e:  # raised in the test's thread below
            out.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@NEEDS_TAP
def test_rtt_over_an_emulated_40_ms_link_reads_40_ms():
    with EmulatedPair(LinkShape(delay_s=0.02)) as pair:
        rtt_s = _in_namespaces(pair)
    assert rtt_s is not None
    assert 0.040 <= rtt_s <= 0.040 * 1.1 + 0.002  # + our own request's handling
