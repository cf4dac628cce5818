"""The digest is BLAKE3 over the documented byte sequence; the bf16 digest rounds float32
exactly as torch's bfloat16 conversion does (what a ``bf16`` download delivers), though it rounds
in numpy; NaNs are canonical on both digest sides."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.swarm.state_digest import ROUND_BLOCK, bf16_rounded_bits, state_digest

pytestmark = pytest.mark.timeout(60)

SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF,  # zeros, subnormals
    0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,  # ties to even, just above and below
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,  # largest finite (rounds to inf), infs
    0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0xFFC00001,  # NaNs
]  # fmt: skip


def _torch_bits(bits: np.ndarray) -> np.ndarray:
    """Torch's rounding, with NaNs canonical (torch's NaN bits depend on the element's place)."""
    values = torch.from_numpy(bits.view(np.float32).copy())
    rounded = values.to(torch.bfloat16).to(torch.float32).numpy().view(np.uint32).copy()
    rounded[np.isnan(values.numpy())] = 0x7FC00000
    return rounded


def test_the_digest_is_blake3_of_the_documented_bytes():
    # the format other peers compute too (peer.swarm.state_digest's docstring), rebuilt here
    tensors = {"optim/0/exp_avg": torch.randn(4, 3), "model/w": torch.randn(5).double()}
    structure = {"0": {"step": 3}}
    expected = blake3(b"vp-state/2")
    expected.update(json.dumps([7, structure], sort_keys=True).encode())
    for name in ("model/w", "optim/0/exp_avg"):  # name order
        tensor = tensors[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        expected.update(json.dumps([name, dtype, list(tensor.shape)]).encode())
        expected.update(tensor.numpy().tobytes())
    assert state_digest(7, tensors, structure=structure) == expected.hexdigest()
    assert len(expected.hexdigest()) == 64  # what the state record's schema takes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4096))
def test_the_rounding_is_torchs_for_any_bit_pattern(words: list[int]):
    bits = np.array(words + SPECIAL_BITS, dtype=np.uint32)
    ours = bf16_rounded_bits(torch.from_numpy(bits.view(np.float32).copy()))
    np.testing.assert_array_equal(ours, _torch_bits(bits))


def test_a_large_tensor_rounds_as_torchs_vectorized_conversion():
    values = torch.randn(1 << 20) * torch.logspace(-40, 38, 1 << 20)
    expected = values.to(torch.bfloat16).to(torch.float32).numpy().view(np.uint32)
    np.testing.assert_array_equal(bf16_rounded_bits(values), expected)


def test_the_bf16_digest_is_the_exact_digest_of_the_rounded_state():
    tensors = {"model/w": torch.randn(300, 70), "model/steps": torch.arange(5)}
    rounded = {
        "model/w": tensors["model/w"].to(torch.bfloat16).to(torch.float32),
        "model/steps": tensors["model/steps"],
    }
    assert state_digest(3, tensors, bf16=True) == state_digest(3, rounded)
    assert state_digest(3, tensors, bf16=True) != state_digest(3, tensors)


def test_a_nan_digests_alike_whatever_bits_torch_gave_it():
    values = torch.tensor([1.0, float("nan"), 2.0] * 11)
    received = values.to(torch.bfloat16).to(torch.float32)  # a downloader's received state
    assert state_digest(1, {"model/w": values}, bf16=True) == state_digest(
        1, {"model/w": received}, bf16=True
    )


def test_a_tensor_of_several_blocks_digests_as_its_rounded_copy():
    # the bf16 digest rounds a block at a time: blocks, their seams and a short last block
    values = torch.randn(3 * ROUND_BLOCK + 5) * torch.logspace(-40, 38, 3 * ROUND_BLOCK + 5)
    values[[0, ROUND_BLOCK - 1, ROUND_BLOCK, 3 * ROUND_BLOCK + 4]] = float("nan")
    rounded = torch.from_numpy(bf16_rounded_bits(values).view(np.float32).copy())
    assert torch.equal(rounded.isnan(), values.isnan())
    expected = values.to(torch.bfloat16).to(torch.float32)
    finite = ~values.isnan()
    assert torch.equal(rounded[finite], expected[finite])
    tensors = {"model/w": values, "model/b": torch.randn(7)}
    same = {"model/w": rounded, "model/b": tensors["model/b"].to(torch.bfloat16).float()}
    assert state_digest(2, tensors, bf16=True) == state_digest(2, same)
