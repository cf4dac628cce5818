"""The butterfly all-reduce over fixed groups of real peers (HttpTransports on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from averaging.rules.compression import fp16_error_bound, uint8_error_bound
from tests.averaging.conftest import exact_mean, make_group, steady_config

pytestmark = pytest.mark.timeout(60)


def flat_of(tensors) -> np.ndarray:
    parts = [t.detach().numpy() if isinstance(t, torch.Tensor) else t for t in tensors]
    return np.concatenate([np.asarray(p, dtype=np.float64).reshape(-1) for p in parts])


def mixed_tensors(rng: np.random.Generator, shapes) -> list:
    """numpy float32, numpy float64 and torch float32 tensors of the given shapes, in turn."""
    tensors = []
    for index, shape in enumerate(shapes):
        values = rng.standard_normal(shape)
        if index % 3 == 0:
            tensors.append(values.astype(np.float32))
        elif index % 3 == 1:
            tensors.append(torch.from_numpy(values.astype(np.float32)))
        else:
            tensors.append(values.astype(np.float32).astype(np.float64))
    return tensors


async def run_group(peers, group):
    return await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))


@pytest.mark.parametrize(
    ("num_peers", "shapes"),
    [
        (2, [(7,)]),
        (3, [(100, 70), (5001,), (1,)]),  # several chunks per part, sizes not divisible by 3
        (5, [(3,)]),  # fewer values than peers: some parts are empty
        (8, [(17, 33), (1025,), (2,), (3, 1, 4)]),
        (4, "random"),
    ],
)
async def test_exact_weighted_mean(make_peers, num_peers, shapes):
    rng = np.random.default_rng(num_peers)
    if shapes == "random":  # a few tensors of random ranks and sizes, up to ~20k values
        shapes = [tuple(rng.integers(1, 30, rng.integers(1, 4))) for _ in range(rng.integers(2, 6))]
    tensor_lists = [mixed_tensors(rng, shapes) for _ in range(num_peers)]
    weights = rng.uniform(0.1, 10.0, num_peers).round(3).tolist()
    expected = exact_mean([flat_of(ts) for ts in tensor_lists], weights)
    # the exact mean is under test, not the waits: 8 peers on one loop of a crowded host took
    # over the fast config's 2 s to connect their 56 streams (every sender dropped, CI)
    config = steady_config()
    peers = await make_peers(tensor_lists, config=config)

    results = await run_group(peers, make_group(peers, weights, chunk_numel=1024))

    for peer, result in zip(peers, results, strict=True):
        assert result.status == "ok", result.reason
        assert result.averaged_fraction == 1.0
        assert set(result.members) == {p.peer_id for p in peers}
        assert result.weights[peer.peer_id] == pytest.approx(weights[peers.index(peer)])
        np.testing.assert_allclose(flat_of(peer.tensors), expected, rtol=1e-5, atol=1e-6)
        for tensor, shape in zip(peer.tensors, shapes, strict=True):
            assert tuple(tensor.shape) == shape  # averaged in place, shapes kept


async def test_one_tensor_is_averaged_in_its_own_memory(make_peers):
    rng = np.random.default_rng(1)
    tensor_lists = [[torch.from_numpy(rng.standard_normal(4000).astype(np.float32))] for _ in "ab"]
    originals = [ts[0] for ts in tensor_lists]
    expected = exact_mean([ts[0].numpy() for ts in tensor_lists], [1.0, 3.0])
    peers = await make_peers(tensor_lists, config=steady_config())
    await run_group(peers, make_group(peers, [1.0, 3.0], chunk_numel=1024))
    for original in originals:
        np.testing.assert_allclose(original.numpy(), expected, rtol=1e-5, atol=1e-6)


def part_bounds(group, numel: int):
    """(start, end) of every chunk of every part, as the group cuts the vector."""
    for part in group.parts(numel):
        for chunk in range(part.num_chunks):
            lo, hi = part.chunk_bounds(chunk)
            yield part.start + lo, part.start + hi


def chunked_bound(bound_fn, values: np.ndarray, group) -> np.ndarray:
    """A codec's per-element error bound, with blocks aligned to the group's chunks."""
    out = np.empty(values.size)
    for lo, hi in part_bounds(group, values.size):
        out[lo:hi] = bound_fn(values[lo:hi])
    return out


@pytest.mark.parametrize("compression", ["fp16", "uint8"])
async def test_compressed_average_within_documented_bound(make_peers, compression):
    rng = np.random.default_rng(7)
    size, weights = 50_001, [1.0, 2.5, 0.5]
    vectors = [
        (rng.standard_normal(size) * rng.uniform(0.1, 100)).astype(np.float32) for _ in weights
    ]
    tensor_lists = [[v.copy()] for v in vectors]
    peers = await make_peers(tensor_lists, config=steady_config())
    group = make_group(peers, weights, compression=compression, chunk_numel=8192)
    expected = exact_mean(vectors, weights)

    results = await run_group(peers, group)

    bound_fn = fp16_error_bound if compression == "fp16" else uint8_error_bound
    total_weight = sum(weights)
    # Each contribution is encoded once on its way up and the average once on its way back.
    bound = sum(
        w / total_weight * chunked_bound(bound_fn, v, group)
        for v, w in zip(vectors, weights, strict=True)
    )
    bound += chunked_bound(bound_fn, expected, group) * 1.01 + 1e-6
    for peer, result in zip(peers, results, strict=True):
        assert result.status == "ok" and result.compression == compression
        error = np.abs(peer.tensors[0].astype(np.float64) - expected)
        assert np.all(error <= bound), f"worst excess {np.max(error - bound)}"
    # Every peer keeps exactly the same values, the reducers included.
    for peer in peers[1:]:
        np.testing.assert_array_equal(peer.tensors[0], peers[0].tensors[0])
    assert results[0].bytes_sent < 4 * size  # the wire carried fewer bytes than float32


async def test_client_mode_peer_sends_and_receives_the_average(make_peers):
    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal(30_000).astype(np.float32) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    expected = exact_mean(vectors, weights)
    peers = await make_peers([[v.copy()] for v in vectors], config=steady_config(), client_mode={3})
    assert peers[3].address is None

    results = await run_group(peers, make_group(peers, weights, chunk_numel=4096))

    assert all(r.status == "ok" for r in results)
    for peer in peers:
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
    client = results[3]
    assert client.bytes_sent > 0 and client.bytes_received > 0
    # It reduced nothing: it received exactly as much as it sent (the three parts, averaged).
    assert client.bytes_sent == client.bytes_received


async def test_peer_with_weight_zero_still_reduces_its_part(make_peers):
    rng = np.random.default_rng(4)
    vectors = [rng.standard_normal(20_000).astype(np.float32) for _ in range(3)]
    weights = [2.0, 0.0, 1.0]
    expected = exact_mean(vectors, weights)
    peers = await make_peers([[v.copy()] for v in vectors], config=steady_config())

    results = await run_group(peers, make_group(peers, weights, chunk_numel=2048))

    assert [r.status for r in results] == ["ok"] * 3
    for peer, result in zip(peers, results, strict=True):
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
        assert result.averaged_fraction == 1.0
    # The weight-0 peer reduced a part: it sent averaged chunks back, though it sent no data up.
    zero = results[1]
    assert zero.bytes_received > 0 and zero.bytes_sent > 0


async def test_two_rounds_back_to_back_with_the_same_peers(make_peers):
    rng = np.random.default_rng(5)
    peers = await make_peers(
        [[np.zeros(9_999, np.float32)] for _ in range(3)], config=steady_config()
    )
    for _ in range(2):
        vectors = [rng.standard_normal(9_999).astype(np.float32) for _ in peers]
        weights = rng.uniform(1, 5, len(peers)).tolist()
        for peer, values in zip(peers, vectors, strict=True):
            peer.tensors[0][:] = values
        results = await run_group(peers, make_group(peers, weights, chunk_numel=1024))
        assert all(r.status == "ok" for r in results)
        for peer in peers:
            np.testing.assert_allclose(
                peer.tensors[0], exact_mean(vectors, weights), rtol=1e-5, atol=1e-6
            )
