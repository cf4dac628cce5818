"""FlatTensors copies any float tensors (strided, half, bfloat16, numpy) into its flat float32
buffer and back, in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from averaging.tensors import FlatTensors

pytestmark = pytest.mark.timeout(30)


def _tensors():
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]  # not contiguous
    return [
        torch.linspace(-1, 1, 50_000),
        strided,
        torch.tensor([0.5, -2.0, 3.25], dtype=torch.float16),
        torch.tensor([1.5, -0.25], dtype=torch.bfloat16),
        np.arange(5, dtype=np.float64),
        torch.ones(3, requires_grad=True),
    ]


def test_gather_reads_every_tensor_in_order():
    tensors = _tensors()
    flat = FlatTensors(tensors)
    flat.gather()
    expected = np.concatenate(
        [t.detach().float().reshape(-1).numpy() if torch.is_tensor(t) else t for t in tensors]
    ).astype(np.float32)
    np.testing.assert_array_equal(flat.flat, expected)


def test_scatter_writes_every_tensor_in_place():
    tensors = _tensors()
    base = tensors[1]._base
    flat = FlatTensors(tensors)
    flat.flat[:] = (np.arange(flat.numel) % 64).astype(np.float32) / 4  # exact in bf16
    flat.scatter()
    offset = 0
    for tensor in tensors:
        values = tensor.detach().float().numpy() if torch.is_tensor(tensor) else tensor
        n = values.size
        np.testing.assert_array_equal(values.reshape(-1), flat.flat[offset : offset + n])
        offset += n
    assert base.reshape(4, 6)[:, 1].tolist() == [1.0, 7.0, 13.0, 19.0]  # unviewed columns stay
