"""Wire formats of tensor chunks: sizes, documented error bounds, malformed payloads."""

from __future__ import annotations

import numpy as np
import pytest

from averaging.errors import BadChunkError
from averaging.rules.compression import (
    FP16_MAX,
    UINT8_BLOCK,
    Compression,
    fp16_error_bound,
    get_codec,
    uint8_error_bound,
)

SIZES = [1, 2, UINT8_BLOCK - 1, UINT8_BLOCK, UINT8_BLOCK + 1, 10 * UINT8_BLOCK + 7]


def roundtrip(name: str, values: np.ndarray) -> np.ndarray:
    codec = get_codec(name)
    codec.prepare()
    payload = memoryview(codec.encode(values)).cast("B")
    assert len(payload) == codec.encoded_nbytes(values.size)
    out = np.empty_like(values)
    codec.decode_into(payload, out)
    return out


def samples(size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(size).astype(np.float32),
        (rng.standard_normal(size) * 1e4 + 3e3).astype(np.float32),
        (rng.standard_normal(size) * 1e-6).astype(np.float32),
        np.full(size, 0.123, dtype=np.float32),  # constant blocks: scale 0
        (rng.standard_normal(size) + 1e6).astype(np.float32),  # far from 0, narrow range
        rng.choice([-1.0, 0.0, 1.0], size).astype(np.float32),
    ]


@pytest.mark.parametrize("size", SIZES)
def test_none_is_exact_and_sends_the_values_own_memory(size):
    for values in samples(size, size):
        np.testing.assert_array_equal(roundtrip("none", values), values)
        assert get_codec("none").encode(values) is values


@pytest.mark.parametrize("size", SIZES)
def test_fp16_within_its_bound(size):
    for values in samples(size, size):
        if np.abs(values).max() > FP16_MAX:
            continue  # clipped: see test_fp16_clips_to_its_range
        error = np.abs(roundtrip("fp16", values).astype(np.float64) - values)
        assert np.all(error <= fp16_error_bound(values))


def test_fp16_clips_to_its_range():
    values = np.array([1e6, -1e6, 65504.0, 1.0], dtype=np.float32)
    np.testing.assert_array_equal(roundtrip("fp16", values), [FP16_MAX, -FP16_MAX, FP16_MAX, 1.0])


@pytest.mark.parametrize("size", SIZES)
def test_uint8_within_its_bound(size):
    for values in samples(size, size):
        error = np.abs(roundtrip("uint8", values).astype(np.float64) - values)
        assert np.all(error <= uint8_error_bound(values))
    assert get_codec("uint8").encoded_nbytes(size) < 1.01 * size + 8


@pytest.mark.parametrize("name", ["none", "fp16", "uint8"])
def test_payload_of_the_wrong_size_is_refused(name):
    codec = get_codec(name)
    payload = memoryview(bytearray(codec.encoded_nbytes(100) + 1))
    with pytest.raises(BadChunkError):
        codec.decode_into(payload, np.empty(100, np.float32))


def test_uint8_payload_with_bad_scales_is_refused():
    codec = get_codec(Compression.UINT8)
    payload = np.frombuffer(bytearray(codec.encode(np.ones(10, np.float32))), np.uint8).copy()
    payload[4:8] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # the scale of block 0
    with pytest.raises(BadChunkError, match="scale"):
        codec.decode_into(memoryview(payload), np.empty(10, np.float32))


@pytest.mark.parametrize("name", ["none", "fp16", "uint8"])
def test_decoding_with_a_factor_scales_the_values(name):
    codec = get_codec(name)
    values = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    payload = memoryview(codec.encode(values)).cast("B")
    plain, scaled = np.empty_like(values), np.empty_like(values)
    codec.decode_into(payload, plain)
    codec.decode_into(payload, scaled, 2.5)
    np.testing.assert_allclose(scaled, 2.5 * plain, rtol=1e-6, atol=1e-6)


def test_uint8_payload_that_would_overflow_is_refused():
    codec = get_codec("uint8")
    payload = np.frombuffer(bytearray(codec.encode(np.ones(10, np.float32))), np.uint8).copy()
    payload[4:8] = np.frombuffer(np.float32(3e37).tobytes(), np.uint8)  # 255 * scale > max
    with pytest.raises(BadChunkError):
        codec.decode_into(memoryview(payload), np.empty(10, np.float32))


def test_unknown_compression():
    with pytest.raises(ValueError):
        get_codec("zip")
