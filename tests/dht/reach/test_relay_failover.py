"""Relays that die: two ``peer dht`` processes relay (on by default); one is killed (or frozen)
while a request to the relayed peer is in flight through it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import numpy as np
import pytest

from dht.errors import RequestTimeoutError, TransportError
from dht.net.config import TransportConfig
from tests.dht.net.test_transport import echo, halve, roundtrip
from tests.dht.reach.test_relay import Reached

pytestmark = pytest.mark.timeout(120)
CHUNK = np.arange(16 * 1024, dtype=np.float32)  # 64 KiB


async def drip(stream):
    """A long reply: 64 KiB chunks, a few per second, until the caller or the path goes."""
    await stream.reply({"chunk_bytes": CHUNK.nbytes})
    for _ in range(2000):
        await stream.send(CHUNK)
        await asyncio.sleep(0.02)


async def slow_echo(ctx, payload):
    await asyncio.sleep(payload)
    return payload


def start_relay() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "peer", "dht", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = process.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), url
    return process, url


@pytest.fixture
async def relays():
    started = await asyncio.gather(*(asyncio.to_thread(start_relay) for _ in range(2)))
    yield started
    for process, _ in started:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=10)


async def start_relayed(make_transport, urls):
    hidden = await make_transport(
        TransportConfig(relay_heartbeat_s=1.0, relay_retry_s=0.5),
        rpc={"echo": echo, "slow_echo": slow_echo},
        streams={"drip": drip, "halve": halve},
    )
    caller = await make_transport(TransportConfig(client_mode=True))
    moved: asyncio.Queue[str] = asyncio.Queue()
    address = await hidden.attach_relay(urls, on_address_change=moved.put_nowait)
    assert address == f"{urls[0]}/v2/relay/{hidden.peer_id}"
    return hidden, caller, address, moved


async def check_moved(hidden, caller, moved, url):
    new = await asyncio.wait_for(moved.get(), timeout=30)
    assert new == f"{url}/v2/relay/{hidden.peer_id}" == hidden.address
    assert hidden.relay_url == url
    answer = await caller.call(new, "echo", "again", expected_peer=hidden.peer_id)
    assert answer == {"payload": "again", "sender": caller.peer_id}
    values = np.random.default_rng(3).standard_normal(500_000).astype(np.float32)
    out = await roundtrip(caller, Reached(hidden, new), values)
    np.testing.assert_array_equal(out, values * np.float32(0.5))


async def test_relay_killed_mid_transfer_fails_in_flight_and_the_peer_moves(make_transport, relays):
    (relay_a, url_a), (_, url_b) = relays
    hidden, caller, address, moved = await start_relayed(make_transport, [url_a, url_b])
    rpc = asyncio.create_task(caller.call(address, "slow_echo", 5.0, timeout_s=30))
    async with caller.open_stream(address, "drip", {}) as stream:
        assert await stream.reply_header() == {"chunk_bytes": CHUNK.nbytes}
        assert await stream.recv() == CHUNK.tobytes()
        relay_a.kill()  # mid-transfer: the stream has thousands of chunks to go
        with pytest.raises(TransportError):
            while await stream.recv() is not None:
                pass
    with pytest.raises(TransportError):
        await rpc
    await check_moved(hidden, caller, moved, url_b)


async def test_a_frozen_relay_is_noticed_by_heartbeat_and_the_peer_moves(make_transport, relays):
    (relay_a, url_a), (_, url_b) = relays
    hidden, caller, address, moved = await start_relayed(make_transport, [url_a, url_b])
    assert (await caller.call(address, "echo", 1))["payload"] == 1
    relay_a.send_signal(signal.SIGSTOP)  # alive to TCP, answering nothing: only pings tell
    with pytest.raises(RequestTimeoutError):
        await caller.call(address, "echo", 2, timeout_s=3)
    await check_moved(hidden, caller, moved, url_b)
