"""A group member that sends bad data is refused and excluded; the others finish the round.

The bad member is a client-mode peer (it reduces no part) that speaks the stream protocol by hand
through its own real transport: NaN values, a header announcing the wrong size or dtype, a chunk
that is not the size its header says, a garbage chunk header, chunks out of order.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from averaging.allreduce.protocol import PartHeader, pack_chunk_header
from dht.errors import DHTError
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig

from .conftest import exact_mean, fast_config, make_group

pytestmark = pytest.mark.timeout(60)
SIZE = 24_000


def nan_chunk(numel: int) -> list[bytes]:
    values = np.ones(numel, dtype=np.float32)
    values[numel // 2] = np.nan
    return [pack_chunk_header(0, 4 * numel), values.tobytes()]


def inf_chunk(numel: int) -> list[bytes]:
    values = np.full(numel, np.inf, dtype=np.float32)
    return [pack_chunk_header(0, 4 * numel), values.tobytes()]


def short_chunk(numel: int) -> list[bytes]:
    return [pack_chunk_header(0, 4 * numel), b"\x00" * (4 * numel - 8)]


def garbage_header(numel: int) -> list[bytes]:
    return [os.urandom(7), b"\x00" * (4 * numel)]


def out_of_order(numel: int) -> list[bytes]:
    return [pack_chunk_header(1, 4 * numel), np.ones(numel, np.float32).tobytes()]


def lying_length(numel: int) -> list[bytes]:
    return [pack_chunk_header(0, 4 * numel + 4), b"\x00" * (4 * numel + 4)]


CHUNK_CASES = {
    "nan": nan_chunk,
    "inf": inf_chunk,
    "short chunk": short_chunk,
    "garbage chunk header": garbage_header,
    "chunk out of order": out_of_order,
    "chunk bigger than announced": lying_length,
}
HEADER_CASES = {
    "wrong numel": lambda h: {**h, "numel": h["numel"] + 1},
    "wrong dtype": lambda h: {**h, "dtype": "float64"},
    "wrong weight": lambda h: {**h, "weight": h["weight"] * 2},
    "unknown compression": lambda h: {**h, "compression": "zip"},
    "not a header": lambda h: [1, 2, 3],
    "a stream the group does not have": lambda h: {**h, "stream": 1},
    "a negative stream": lambda h: {**h, "stream": -1},
}


def client_transport() -> HttpTransport:
    return HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))


async def send_bad_stream(transport, group, part, header: dict, frames: list[bytes]) -> str:
    """Open the part's stream with ``header``, send ``frames``; how the reducer answered."""
    reducer = group.members[part.index]
    try:
        async with transport.open_stream(
            reducer.address, "averaging.t.part", header, timeout_s=10
        ) as stream:
            for frame in frames:
                await stream.send(frame)
            await stream.finish_sending()
            await stream.reply_header()
            while await stream.recv() is not None:
                pass
    except DHTError as e:
        return f"refused: {e}"
    return "accepted"


async def run_with_bad_peer(make_peers, header_change, chunk_frames):
    rng = np.random.default_rng(11)
    vectors = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    honest = await make_peers([[v.copy()] for v in vectors], config=fast_config())
    async with client_transport() as bad:
        group = make_group([*honest, bad], [*weights, 5.0], chunk_numel=2048)
        parts = group.parts(SIZE)
        bad_streams = []
        for part in parts:
            if not part.numel:
                continue
            header = PartHeader(
                group.group_id, part.index, 5.0, part.numel, group.compression, part.chunk_numel
            ).to_wire()
            frames = chunk_frames(part.chunk_size(0)) if chunk_frames else []
            bad_streams.append(send_bad_stream(bad, group, part, header_change(header), frames))
        *results, answers = await asyncio.gather(
            *(p.averager.step_in_group(group) for p in honest), asyncio.gather(*bad_streams)
        )
    return honest, results, answers, bad.peer_id, exact_mean(vectors, weights)


def check_refused_and_others_averaged(honest, results, answers, bad_id, expected):
    assert answers and all(a.startswith("refused") for a in answers), answers
    for peer, result in zip(honest, results, strict=True):
        assert bad_id in result.dropped_peers
        assert result.status == "partial"
        # Nothing of the bad peer's went into the average: the exact mean of the honest three.
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CHUNK_CASES)
async def test_bad_chunk_is_refused_and_its_sender_excluded(make_peers, case):
    outcome = await run_with_bad_peer(make_peers, lambda h: h, CHUNK_CASES[case])
    check_refused_and_others_averaged(*outcome)


@pytest.mark.parametrize("case", HEADER_CASES)
async def test_bad_header_is_refused_and_its_sender_excluded(make_peers, case):
    outcome = await run_with_bad_peer(make_peers, HEADER_CASES[case], None)
    check_refused_and_others_averaged(*outcome)


async def test_stream_from_a_stranger_is_refused(make_peers):
    peers = await make_peers([[np.ones(100, np.float32)] for _ in range(2)], config=fast_config())
    group = make_group(peers)
    part = group.parts(100)[0]
    header = PartHeader(group.group_id, 0, 1.0, part.numel, group.compression, part.chunk_numel)
    async with HttpTransport(
        PeerIdentity.generate(), TransportConfig(client_mode=True)
    ) as stranger:
        step = asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
        answer = await send_bad_stream(stranger, group, part, header.to_wire(), [])
        results = await step
    assert answer.startswith("refused") and "not a member" in answer
    assert all(r.status == "ok" for r in results)


async def test_round_is_bounded_by_the_allreduce_timeout(make_peers):
    """A member that accepts streams, then says nothing, and whom the generous sender and
    reducer timeouts would wait for: the round still ends at ``allreduce_timeout_s``."""
    release = asyncio.Event()

    async def silent(stream):
        await stream.reply({"ok": True})
        await release.wait()

    config = fast_config(allreduce_timeout_s=1.0, sender_timeout_s=8.0, reducer_timeout_s=16.0)
    vectors = [np.full(5_000, float(i), np.float32) for i in range(2)]
    peers = await make_peers([[v.copy()] for v in vectors], config=config)
    mute = HttpTransport(PeerIdentity.generate(), TransportConfig())
    mute.add_stream_handler("averaging.t.part", silent)
    async with mute:
        group = make_group([*peers, mute], chunk_numel=1024)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(p.averager.step_in_group(group) for p in peers)), 10
            )
        finally:
            release.set()
    for peer, result, values in zip(peers, results, vectors, strict=True):
        # Every chunk still waited for the mute member's contribution: nothing was averaged,
        # and every value is this peer's own.
        assert result.status == "failed" and not result.averaged
        assert "allreduce_timeout_s" in result.reason
        assert mute.peer_id in result.dropped_peers
        np.testing.assert_array_equal(peer.tensors[0], values)
