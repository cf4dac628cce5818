"""A peer behind a real NAT (a masquerading router namespace) is reached through a relay: nobody
can dial its server, yet RPCs and full-duplex streams reach it, proven end to end. Needs root,
iproute2, nftables and /dev/net/tun; CI runs as root."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from dht.errors import RequestTimeoutError, TransportError
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from experiments.launch.base import ProcessPlan
from experiments.launch.netns import NetnsSession, address_of
from experiments.launch.netns_links import LAN_PEER_ADDRESS
from tests.dht.net.test_transport import echo, halve, roundtrip
from tests.dht.reach.test_relay import Reached
from tests.experiments.launch.namespace_loop import LoopInNamespace
from tests.experiments.launch.test_nat import PORT, _in, _network

pytestmark = pytest.mark.timeout(120)
if os.geteuid() != 0 or shutil.which("nft") is None or not os.path.exists("/dev/net/tun"):
    pytestmark = [pytestmark, pytest.mark.skip(reason="needs root, nftables and /dev/net/tun")]


class RelayedPeer(LoopInNamespace):
    """A relayed peer's transport on its own event loop, in a thread inside ``namespace``;
    :meth:`start` returns (relayed address, peer id, the server's own URL)."""

    def __init__(self, namespace: str, relay_url: str):
        super().__init__(namespace)
        self._relay_url = relay_url

    async def serve(self) -> None:
        config = TransportConfig(host=LAN_PEER_ADDRESS, port=0, relay_heartbeat_s=2.0)
        async with HttpTransport(PeerIdentity.generate(), config) as transport:
            transport.add_rpc_handler("echo", echo)
            transport.add_stream_handler("halve", halve)
            own_url = transport.address
            address = await transport.attach_relay([self._relay_url])
            self.started((address, transport.peer_id, own_url))
            await self.stopped()


async def call_through(address: str, peer_id: str, own_url: str) -> dict:
    config = TransportConfig(client_mode=True, request_timeout_s=5.0, connect_timeout_s=3.0)
    async with HttpTransport(PeerIdentity.generate(), config) as caller:
        answer = await caller.call(address, "echo", {"hi": 1}, expected_peer=peer_id)
        values = np.random.default_rng(4).standard_normal(1_000_003).astype(np.float32)
        out = await roundtrip(caller, Reached(caller, address), values)
        try:
            await caller.call(own_url, "echo", 1, timeout_s=3)
            direct = "reached"
        except (RequestTimeoutError, TransportError) as e:
            direct = type(e).__name__
        return {
            "answer": answer,
            "exact": bool(np.array_equal(out, values * np.float32(0.5))),
            "caller": caller.peer_id,
            "direct": direct,
        }


def test_a_peer_behind_nat_is_reached_through_a_relay(tmp_path: Path):
    prefix = f"vpx-r{os.getpid()}"
    with NetnsSession(tmp_path, prefix, 2, _network(), emulator="linkemu") as session:
        reachable, home = session.namespaces
        relay_plan = ProcessPlan(
            name="relay", args=["-m", "peer", "dht", "--port", str(PORT)], index=0, metrics=False
        )
        relay = session.start(relay_plan)
        relay_url = f"http://{address_of(0)}:{PORT}"
        out_file = tmp_path / "relay.out"
        deadline = time.monotonic() + 30
        while relay_url not in (out_file.read_text() if out_file.exists() else ""):
            assert time.monotonic() < deadline and relay.process.poll() is None, "relay died"
            time.sleep(0.05)
        peer = RelayedPeer(home, relay_url)
        address, peer_id, own_url = peer.start()
        try:
            assert own_url.startswith(f"http://{LAN_PEER_ADDRESS}:")
            assert address == f"{relay_url}/v2/relay/{peer_id}"
            got = _in(reachable, lambda: asyncio.run(call_through(address, peer_id, own_url)))
        finally:
            peer.stop()
            relay.process.kill()
            relay.process.wait(timeout=10)
    assert got["answer"] == {"payload": {"hi": 1}, "sender": got["caller"]}
    assert got["exact"]
    assert got["direct"] != "reached"  # its own server cannot be dialled from outside
