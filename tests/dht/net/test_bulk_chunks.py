"""Large stream payloads reach the socket as the caller's own memory, over real loopback."""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import asyncio.transports

import numpy as np
import pytest

from dht.errors import TransportError
from dht.net.bulk_chunks import BULK_MIN_BYTES, BulkChunkWriter
from tests.socket_writes import bytes_handed_from

pytestmark = pytest.mark.timeout(60)


async def test_large_payloads_reach_the_socket_uncopied_both_ways(make_transport, transport_writes):
    chunk_numel = 1 << 18  # 1 MiB of float32 per chunk
    rng = np.random.default_rng(0)
    up = rng.standard_normal(4 * chunk_numel).astype(np.float32)
    down = rng.standard_normal(4 * chunk_numel).astype(np.float32)
    received_up = np.empty_like(up)

    async def handler(stream):
        await stream.reply({"ok": True})
        filled = 0
        target = memoryview(received_up).cast("B")
        while (num_bytes := await stream.recv_into(target[filled:])) is not None:
            filled += num_bytes
        for lo in range(0, down.size, chunk_numel):
            await stream.send(memoryview(down[lo : lo + chunk_numel]).cast("B"))

    server = await make_transport(streams={"bulk": handler})
    client = await make_transport()
    received_down = np.empty_like(down)
    async with client.open_stream(server.address, "bulk", {}) as stream:
        for lo in range(0, up.size, chunk_numel):
            await stream.send(memoryview(up[lo : lo + chunk_numel]).cast("B"))
        await stream.finish_sending()
        assert await stream.reply_header() == {"ok": True}
        filled, target = 0, memoryview(received_down).cast("B")
        while (num_bytes := await stream.recv_into(target[filled:])) is not None:
            filled += num_bytes

    np.testing.assert_array_equal(received_up, up)
    np.testing.assert_array_equal(received_down, down)
    # every byte of both tensors went to a socket straight from the tensor's memory
    assert bytes_handed_from(transport_writes, up) == up.nbytes
    assert bytes_handed_from(transport_writes, down) == down.nbytes


async def test_a_reply_buffer_may_change_once_send_returns(make_transport, monkeypatch):
    """A large write returns only when the transport holds none of its bytes (Python 3.12 and
    later keep a reference to the buffer, not a copy): the caller may reuse it at once. The
    transports here buffer up to 64 MiB before they push back, so that nothing but that rule
    keeps the writer waiting."""
    original = asyncio.transports._FlowControlMixin._set_write_buffer_limits

    def generous_limits(self, high=None, low=None):
        original(self, high=64 << 20 if high is None else high, low=low)

    monkeypatch.setattr(
        asyncio.transports._FlowControlMixin, "_set_write_buffer_limits", generous_limits
    )
    chunk_numel = 2 << 20  # 8 MiB frames, the largest allowed: more than the socket buffers take
    values = np.arange(2 * chunk_numel, dtype=np.float32)
    expected = values.copy()

    async def handler(stream):
        await stream.reply({"numel": values.size})
        for lo in range(0, values.size, chunk_numel):
            chunk = values[lo : lo + chunk_numel]
            await stream.send(memoryview(chunk).cast("B"))
            chunk.fill(np.nan)  # the next round's values, say

    server = await make_transport(streams={"reuse": handler})
    client = await make_transport()
    received = np.empty_like(values)
    async with client.open_stream(server.address, "reuse", {}) as stream:
        await stream.finish_sending()
        assert await stream.reply_header() == {"numel": values.size}
        await asyncio.sleep(0.3)  # the reply fills the socket buffers; the writer must wait
        filled, target = 0, memoryview(received).cast("B")
        while (num_bytes := await stream.recv_into(target[filled:])) is not None:
            filled += num_bytes
    assert filled == values.nbytes
    np.testing.assert_array_equal(received, expected)


async def test_a_stream_left_mid_write_sends_none_of_the_callers_later_values(make_transport):
    """The caller leaves while its chunks still wait to be written, then changes its values:
    the connection is cut, and what was not yet in the kernel (on Python 3.12 and later a view
    of the caller's memory) never goes out."""
    received = {"bytes": 0, "changed": 0}
    release, finished = asyncio.Event(), asyncio.Event()

    async def slow_reader(stream):
        await stream.reply({"ok": True})
        await release.wait()
        buffer = memoryview(bytearray(8 << 20))
        try:
            while (num_bytes := await stream.recv_into(buffer)) is not None:
                values = np.frombuffer(buffer[:num_bytes], dtype=np.float32)
                received["changed"] += int(np.isnan(values).sum())
                received["bytes"] += num_bytes
        except TransportError:
            pass  # the connection was cut
        finally:
            finished.set()

    server = await make_transport(streams={"slow": slow_reader})
    client = await make_transport()
    values = np.arange(2 << 20, dtype=np.float32)  # 8 MiB frames: more than the sockets hold
    async with client.open_stream(server.address, "slow", {}) as stream:
        assert await stream.reply_header() == {"ok": True}
        for _ in range(3):
            await stream.send(memoryview(values).cast("B"))
        await asyncio.sleep(0.3)  # the body's writer waits for the reader
    values.fill(np.nan)  # the caller's next values
    release.set()
    await asyncio.wait_for(finished.wait(), timeout=20)
    assert received["changed"] == 0
    assert received["bytes"] < 3 * values.nbytes


def test_only_aiohttps_chunked_writer_is_bypassed():
    assert BulkChunkWriter.wrap(object()) is None
    assert BulkChunkWriter.wrap(None) is None
    assert BULK_MIN_BYTES >= 4096  # small pieces keep aiohttp's own path
