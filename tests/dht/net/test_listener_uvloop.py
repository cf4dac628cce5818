"""The per-address share of new connections under uvloop, whose accept never calls the listening
socket's ``accept()`` (:class:`dht.net.listener.GatedSocket`): the gate then checks each new
connection once aiohttp has set it up (``ConnectionGate.install``), and the share still holds.
Nothing in the project installs uvloop; this is what a host that does gets."""

from __future__ import annotations

import asyncio

import pytest
import uvloop  # (installed with hivemind, which switches to it)

from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from dht.net.listener import accept_is_gated
from tests.dht.net.test_connection_gate import assert_a_reconnecting_sender_gets_its_burst

pytestmark = pytest.mark.timeout(60)


async def _echo(ctx, payload):
    return payload


async def _reconnecting_sender_gets_its_share() -> None:
    config = TransportConfig(max_connection_accepts_per_s_per_address=0.05,
                             connection_accept_burst_per_address=20)  # fmt: skip
    async with (
        HttpTransport(PeerIdentity.generate(), config) as node,
        HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True)) as honest,
    ):
        node.add_rpc_handler("echo", _echo)
        assert not accept_is_gated(asyncio.get_running_loop())
        await assert_a_reconnecting_sender_gets_its_burst(node, honest)


def test_under_uvloop_a_reconnecting_sender_still_gets_its_share_of_connections():
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_reconnecting_sender_gets_its_share())


async def test_the_default_loop_gates_at_accept():
    assert accept_is_gated(asyncio.get_running_loop())
