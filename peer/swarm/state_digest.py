"""The digest of a peer's state at an epoch: what donors announce and downloaders check.

``digest = blake3("vp-state/2", epoch, structure, then for each tensor in name order: name,
dtype, shape, raw little-endian bytes)``, 32 bytes in hex. BLAKE3, not SHA-256 (``vp-state/1``):
a donor digests its state at every epoch, twice, and BLAKE3 hashes 8 MB in 0.8 ms on one core of
this project's test host against 4.1 ms for SHA-256 (with SHA-NI); like hashlib it releases the
GIL, and one call uses one thread. ``structure`` is the optimizer's state as
:func:`peer.train.checkpoint.pack_state` encodes it (which tensor is whose moment, and any
scalars), canonical JSON; the optimizer's hyperparameters are not in it, since a downloader
takes its own from its local config. The epoch is, so that a state cannot be relabelled.

What a digest covers is the part of the state that peers of a run share exactly
(:func:`digest_scope`): the model and the optimizer in ``grad`` mode (every peer applies the same
averaged gradient to the same parameters); the model only in ``params`` and ``diloco`` modes, where
each peer's inner optimizer is its own. The bf16 digest is of the same state with every float32
tensor rounded to bfloat16 and back, which is what a ``bf16`` download delivers.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from blake3 import blake3

DIGEST_TAG = b"vp-state/2"
MODEL_PREFIX = "model/"
OPTIMIZER_PREFIX = "optim"
# float32 elements rounded to bfloat16 and hashed at a time (256 KiB: fits a core's L2 cache)
ROUND_BLOCK = 1 << 16


def digest_scope(mode: str) -> tuple[str, ...]:
    """The tensor name prefixes a digest covers in ``mode`` (``grad``: the optimizer too)."""
    return (MODEL_PREFIX, OPTIMIZER_PREFIX) if mode == "grad" else (MODEL_PREFIX,)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def bf16_rounded_bits(tensor: torch.Tensor) -> np.ndarray:
    """The bits of a float32 ``tensor`` rounded to bfloat16 and back, as torch rounds it
    (nearest, ties to even), except that every NaN becomes 0x7FC00000: torch's own NaN bits
    differ between its vectorized and scalar paths, and both digest sides round (the donor its
    state, the downloader what it received), so canonical NaNs agree.

    In numpy, which runs on the calling thread alone: a torch conversion on the digest's worker
    thread would start a second OpenMP team beside the training thread's, and on a machine with
    as many cores as torch threads the two teams' spinning halved the training speed.
    """
    bits = tensor.reshape(-1).numpy().view(np.uint32)
    rounded = np.empty_like(bits)
    _round_into(bits, rounded, np.empty_like(bits), np.empty(bits.size, dtype=bool))
    return rounded


def _round_into(bits: np.ndarray, out: np.ndarray, carry: np.ndarray, nan: np.ndarray) -> None:
    """``out[:] = bf16_rounded_bits(bits)`` with no array allocated (all four of one size)."""
    np.right_shift(bits, 16, out=carry)
    np.bitwise_and(carry, 1, out=carry)
    np.add(carry, 0x7FFF, out=carry)  # round half to even: 0x7FFF, or 0x8000 on an odd bit
    np.add(bits, carry, out=out)
    np.bitwise_and(out, np.uint32(0xFFFF0000), out=out)
    np.isnan(bits.view(np.float32), out=nan)
    if nan.any():
        out[nan] = np.uint32(0x7FC00000)


class _Rounder:
    """Hashes float32 tensors rounded to bfloat16 a block at a time, in buffers it reuses: no
    temporary of a tensor's size (each was a fresh mapping, faulted in page by page), and a
    block is hashed while it is still in the cache."""

    def __init__(self) -> None:
        self._buffers = (
            np.empty(ROUND_BLOCK, np.uint32),
            np.empty(ROUND_BLOCK, np.uint32),
            np.empty(ROUND_BLOCK, dtype=bool),
        )

    def hash_rounded(self, hasher, tensor: torch.Tensor) -> None:
        bits = tensor.reshape(-1).numpy().view(np.uint32)
        out, carry, nan = self._buffers
        for start in range(0, bits.size, ROUND_BLOCK):
            block = bits[start : start + ROUND_BLOCK]
            n = block.size
            _round_into(block, out[:n], carry[:n], nan[:n])
            hasher.update(memoryview(out[:n]).cast("B"))


def state_digest(
    epoch: int,
    tensors: dict[str, torch.Tensor],
    *,
    scope: tuple[str, ...] | None = None,
    structure: Any = None,
    bf16: bool = False,
) -> str:
    """The hex digest of ``tensors`` (those under ``scope``'s prefixes; all when None) at
    ``epoch`` with the optimizer ``structure``; ``bf16``: of the float32 tensors rounded to
    bfloat16. CPU, contiguous tensors; call it off the event loop (hashing releases the GIL)."""
    hasher = blake3(DIGEST_TAG)
    hasher.update(json.dumps([epoch, structure], sort_keys=True).encode())
    rounder = _Rounder() if bf16 else None
    for name in sorted(tensors):
        if scope is not None and not name.startswith(scope):
            continue
        tensor = tensors[name].detach().contiguous()
        header = [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
        hasher.update(json.dumps(header).encode())
        if rounder is not None and tensor.dtype == torch.float32:
            rounder.hash_rounded(hasher, tensor)
        else:
            hasher.update(_byte_view(tensor))
    return hasher.hexdigest()


def optimizer_structure(header: dict[str, Any]) -> Any:
    """The optimizer's state structure of a packed state's header (no hyperparameters), or
    None when it has none. Raises ``ValueError`` (or ``KeyError``, ``TypeError``) when the
    header is malformed."""
    encoded = header.get("optimizer")
    if encoded is None:
        return None
    for key, value in encoded["d"]:
        if key == "state":
            return value
    raise ValueError("the optimizer state has no 'state'")
