"""How the all-reduce's bulk bytes travel: from the tensors' own memory to the sockets, with no
copy of a whole part on the way (real peers over loopback, result against the float64 mean)."""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import tracemalloc

import numpy as np
import pytest

from tests.averaging.conftest import exact_mean, fast_config, make_group
from tests.socket_writes import bytes_handed_from

pytestmark = pytest.mark.timeout(60)

NUM_PEERS = 3
CHUNK_NUMEL = 1 << 16  # 256 KiB chunks: every one is a bulk write
NUMEL = NUM_PEERS * 4 * CHUNK_NUMEL  # each part is 4 whole chunks
# Fixed, generous waits for the round traced for memory: tracemalloc slows it several times,
# and waits learned from the untraced warm-up round (1 s, the floor) dropped a sender of it
TRACED_CONFIG = fast_config(
    adaptive_deadlines=False,
    sender_timeout_s=10.0,
    reducer_timeout_s=20.0,
    allreduce_timeout_s=40.0,
)


async def test_chunks_go_to_the_sockets_from_the_tensors_own_memory(make_peers, transport_writes):
    rng = np.random.default_rng(7)
    tensors = [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(NUM_PEERS)]
    weights = [0.5, 1.25, 3.0]
    expected = exact_mean(tensors, weights)
    peers = await make_peers([[t] for t in tensors], config=fast_config())

    results = await _one_round(peers, weights)

    for result, tensor in zip(results, tensors, strict=True):
        assert result.status == "ok", result.reason
        np.testing.assert_allclose(tensor, expected, rtol=1e-5, atol=1e-6)
    # Each peer sends the other parts of its vector as a sender and the average of its own part
    # to each other member as a reducer: (NUMEL - part) + (NUM_PEERS - 1) * part values, all
    # handed to a socket as views of its tensor (the vector is averaged in its own memory).
    part_bytes = tensors[0].nbytes // NUM_PEERS
    for tensor in tensors:
        handed = bytes_handed_from(transport_writes, tensor)
        assert handed == tensor.nbytes - part_bytes + (NUM_PEERS - 1) * part_bytes


async def test_a_rounds_memory_grows_with_chunks_in_flight_not_with_the_vector(make_peers):
    """Peak memory traced over a round of three peers in this process: windows and buffers of a
    few chunks each (~14 MB in all), not copies of the parts that cross the sockets (~100 MB)."""
    numel = NUM_PEERS * 32 * CHUNK_NUMEL
    rng = np.random.default_rng(8)
    tensors = [rng.standard_normal(numel).astype(np.float32) for _ in range(NUM_PEERS)]
    weights = [1.0, 2.0, 0.75]
    peers = await make_peers([[t] for t in tensors], config=TRACED_CONFIG)
    await _one_round(peers, weights)  # warm: connections, sessions, pools
    for tensor in tensors:
        tensor[:] = rng.standard_normal(numel)
    expected = exact_mean(tensors, weights)
    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        results = await _one_round(peers, weights)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for result, tensor in zip(results, tensors, strict=True):
        assert result.status == "ok", result.reason
        np.testing.assert_allclose(tensor, expected, rtol=1e-5, atol=1e-6)
    crossing_bytes = sum(t.nbytes for t in tensors) * 2 * (NUM_PEERS - 1) // NUM_PEERS
    assert peak - baseline < crossing_bytes / 4, f"{peak - baseline} bytes at the peak"


async def _one_round(peers, weights):
    group = make_group(peers, weights, chunk_numel=CHUNK_NUMEL)
    return await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
