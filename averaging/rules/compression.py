"""Wire formats of tensor chunks: none, fp16, and 8-bit blockwise quantization.

Every codec turns a 1-D float32 array into a byte payload of a size known in advance from the
number of values (so a receiver can check each chunk's length before reading it) and back. The
average is always computed in float32, whatever the wire format.

Error bounds (per element ``x``, reconstructed ``x'``):

* ``none``: exact.
* ``fp16``: values are clipped to the float16 range ``[-65504, 65504]``, then rounded to nearest:
  ``|x - x'| <= max(|x| * 2**-11, 2**-25)`` for ``|x| <= 65504``.
* ``uint8``: blocks of :data:`UINT8_BLOCK` values; each block stores its minimum ``lo`` and
  ``scale = (hi - lo) / 255`` as float32 and one code per value, ``x' = lo + code * scale``:
  ``|x - x'| <= (hi - lo) / 510`` plus float32 rounding of the reconstruction
  (``<= 2**-23 * max(|lo|, |hi|)``). See :func:`uint8_error_bound`.

Layouts (little-endian): ``none`` = float32 values; ``fp16`` = float16 values; ``uint8`` =
``lo[num_blocks]`` float32, ``scale[num_blocks]`` float32, then ``codes[numel]`` uint8 (the float
arrays first, so every view is aligned).
"""

from __future__ import annotations

import enum
from typing import Protocol

import numpy as np

from averaging.errors import BadChunkError

FP16_MAX = 65504.0
UINT8_BLOCK = 1024
_UINT8_LEVELS = 255.0


class Compression(enum.StrEnum):
    """Wire format of a tensor part, chosen per round."""

    NONE = "none"
    FP16 = "fp16"
    UINT8 = "uint8"


class Codec(Protocol):
    """Encodes float32 chunks for the wire and decodes them back."""

    compression: Compression
    is_identity: bool  # the payload is the float32 values themselves
    checks_finite: bool  # decode_into refuses payloads that would decode to NaN or Inf

    def encoded_nbytes(self, numel: int) -> int:
        """The exact payload size of ``numel`` values, in bytes."""

    def encode(self, values: np.ndarray) -> np.ndarray:
        """The payload of ``values`` (1-D float32) as a byte-addressable array."""

    def decode_into(self, payload: memoryview, out: np.ndarray, factor: float = 1.0) -> None:
        """Decode ``payload`` times ``factor`` into ``out`` (1-D float32).

        Raises:
            BadChunkError: the payload is malformed (``out`` is then left untouched).
        """

    def prepare(self) -> None:
        """Load what the codec needs (may take seconds once; call it off the event loop)."""


def _check_nbytes(payload: memoryview, expected: int) -> None:
    if len(payload) != expected:
        raise BadChunkError(f"chunk of {len(payload)} bytes, expected {expected}")


class NoCompression:
    """Raw float32: the payload is the values' own memory (no copy)."""

    compression = Compression.NONE
    is_identity = True
    checks_finite = False

    def prepare(self) -> None:
        pass

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, values: np.ndarray) -> np.ndarray:
        return values

    def decode_into(self, payload: memoryview, out: np.ndarray, factor: float = 1.0) -> None:
        _check_nbytes(payload, 4 * out.size)
        np.multiply(np.frombuffer(payload, dtype="<f4"), np.float32(factor), out=out)


class Float16Compression:
    """IEEE half precision, values clipped to its finite range."""

    compression = Compression.FP16
    is_identity = False
    checks_finite = False

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    # torch converts float32 <-> float16 about 8x faster than numpy (which does it in software);
    # it is imported on first use so that peers that never use fp16 do not pay for the import.

    def prepare(self) -> None:
        import torch  # noqa: F401

    def encode(self, values: np.ndarray) -> np.ndarray:
        if values.size and (values.min() < -FP16_MAX or values.max() > FP16_MAX):
            values = np.clip(values, -FP16_MAX, FP16_MAX)
        out = np.empty(values.size, dtype="<f2")
        _convert(out, values)
        return out

    def decode_into(self, payload: memoryview, out: np.ndarray, factor: float = 1.0) -> None:
        _check_nbytes(payload, 2 * out.size)
        halves = np.frombuffer(payload, dtype="<f2")
        if halves.flags.writeable:
            _convert(out, halves)
        else:  # torch wants writable memory; a read-only payload takes numpy's slower path
            out[:] = halves
        if factor != 1.0:
            out *= np.float32(factor)


# torch's own grain size: an op on fewer elements runs on the calling thread. Converting in such
# slices keeps torch's OpenMP pool out of it: several peer processes on few cores would otherwise
# spend their time in its spinning threads (a 10x slowdown measured with 4 peers on 2 cores).
_TORCH_GRAIN = 32768


def _convert(out: np.ndarray, source: np.ndarray) -> None:
    """``out[:] = source`` between float32 and float16, by torch, single-threaded."""
    import torch

    target, origin = torch.from_numpy(out), torch.from_numpy(source)
    for start in range(0, out.size, _TORCH_GRAIN):
        target[start : start + _TORCH_GRAIN].copy_(origin[start : start + _TORCH_GRAIN])


class Uint8BlockwiseCompression:
    """Affine 8-bit quantization with a float32 minimum and scale per block of values."""

    compression = Compression.UINT8
    is_identity = False
    checks_finite = True  # codes are bounded: finite block parameters mean finite values

    def __init__(self, block: int = UINT8_BLOCK):
        self.block = block

    def prepare(self) -> None:
        pass

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_nbytes(self, numel: int) -> int:
        return 8 * self.num_blocks(numel) + numel

    def encode(self, values: np.ndarray) -> np.ndarray:
        numel, num_blocks = values.size, self.num_blocks(values.size)
        payload = np.empty(self.encoded_nbytes(numel), dtype=np.uint8)
        lo = payload[: 4 * num_blocks].view("<f4")
        scale = payload[4 * num_blocks : 8 * num_blocks].view("<f4")
        codes = payload[8 * num_blocks :]
        for blocks, lo_b, scale_b, codes_b in self._split(values, lo, scale, codes):
            np.min(blocks, axis=1, out=lo_b)
            np.max(blocks, axis=1, out=scale_b)
            scale_b -= lo_b
            scale_b *= 1.0 / _UINT8_LEVELS
            # A constant block has scale 0: every code is 0 and decodes to lo exactly.
            inverse = np.divide(1.0, scale_b, out=np.zeros_like(scale_b), where=scale_b > 0)
            # Subtract first: x - lo is exact for values close to lo, whatever their magnitude.
            shifted = blocks - lo_b[:, None]
            shifted *= inverse[:, None]
            # Now 0 <= shifted <= 255 (to within rounding), so truncating shifted + 0.5 rounds
            # to the nearest code and never leaves 0..255.
            shifted += 0.5
            np.copyto(codes_b, shifted, casting="unsafe")
        return payload

    def decode_into(self, payload: memoryview, out: np.ndarray, factor: float = 1.0) -> None:
        numel, num_blocks = out.size, self.num_blocks(out.size)
        _check_nbytes(payload, self.encoded_nbytes(numel))
        raw = np.frombuffer(payload, dtype=np.uint8)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is refused just below
            lo = raw[: 4 * num_blocks].view("<f4") * np.float32(factor)
            scale = raw[4 * num_blocks : 8 * num_blocks].view("<f4") * np.float32(factor)
            top = lo + _UINT8_LEVELS * scale
        if not (np.isfinite(top).all() and np.isfinite(lo).all() and (scale >= 0).all()):
            raise BadChunkError("uint8 chunk with a non-finite or negative block scale")
        codes = raw[8 * num_blocks :]
        for out_b, lo_b, scale_b, codes_b in self._split(out, lo, scale, codes):
            np.multiply(codes_b, scale_b[:, None], out=out_b)
            out_b += lo_b[:, None]

    def _split(self, values: np.ndarray, lo, scale, codes):
        """(values, lo, scale, codes) of the full blocks, then of the short last block."""
        num_full = values.size // self.block
        cut = num_full * self.block
        parts = []
        if num_full:
            parts.append(
                (
                    values[:cut].reshape(num_full, self.block),
                    lo[:num_full],
                    scale[:num_full],
                    codes[:cut].reshape(num_full, self.block),
                )
            )
        if cut < values.size:
            parts.append(
                (
                    values[cut:].reshape(1, -1),
                    lo[num_full:],
                    scale[num_full:],
                    codes[cut:].reshape(1, -1),
                )
            )
        return parts


_CODECS: dict[Compression, Codec] = {
    Compression.NONE: NoCompression(),
    Compression.FP16: Float16Compression(),
    Compression.UINT8: Uint8BlockwiseCompression(),
}


def get_codec(compression: Compression | str) -> Codec:
    """The codec of ``compression`` ("none", "fp16" or "uint8").

    Raises:
        ValueError: an unknown compression name.
    """
    return _CODECS[Compression(compression)]


def fp16_error_bound(values: np.ndarray) -> np.ndarray:
    """Per-element bound on ``|x - decode(encode(x))|`` for fp16 (values within its range)."""
    return np.maximum(np.abs(values.astype(np.float64)) * 2.0**-11, 2.0**-25)


def uint8_error_bound(values: np.ndarray, block: int = UINT8_BLOCK) -> np.ndarray:
    """Per-element bound on ``|x - decode(encode(x))|`` for the 8-bit blockwise codec."""
    x = values.astype(np.float64)
    pad = (-x.size) % block
    padded = np.concatenate([x, np.full(pad, x[-1] if x.size else 0.0)]).reshape(-1, block)
    lo, hi = padded.min(axis=1), padded.max(axis=1)
    per_block = (hi - lo) * (1 / 510.0 + 2.0**-20) + 2.0**-22 * np.maximum(np.abs(lo), np.abs(hi))
    return np.repeat(per_block, block)[: x.size]
