"""The averaged tensors seen as one flat float32 vector.

A single contiguous float32 tensor on the CPU (torch or numpy) is used in place: the vector is a
view of its memory and nothing is copied. Anything else (several tensors, other dtypes, a GPU) is
gathered into a float32 buffer allocated once, and the result scattered back after the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from averaging.errors import ConfigError


def _is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.split(".")[0] == "torch"


def _check(tensor: Any) -> int:
    if _is_torch(tensor):
        if not tensor.is_floating_point():
            raise ConfigError(f"tensors must be floating point, got {tensor.dtype}")
        return tensor.numel()
    if isinstance(tensor, np.ndarray):
        if not np.issubdtype(tensor.dtype, np.floating):
            raise ConfigError(f"tensors must be floating point, got {tensor.dtype}")
        return tensor.size
    raise ConfigError(f"tensors must be torch tensors or numpy arrays, got {type(tensor).__name__}")


def _numpy_readable(tensor: Any) -> bool:
    import torch

    return tensor.device.type == "cpu" and tensor.dtype not in (torch.bfloat16, torch.complex32)


def _numpy_view(tensor: Any) -> np.ndarray:
    """``tensor``'s values as numpy (a view of its memory where torch allows one).

    Copies go through numpy, not torch: they run on a worker thread, where a torch copy would
    start a second OpenMP team beside the training thread's (see peer.swarm.state_digest).
    """
    if not _is_torch(tensor):
        return tensor
    if _numpy_readable(tensor):
        return tensor.detach().numpy()
    return tensor.detach().float().cpu().numpy()  # a GPU or bfloat16 tensor: a copy to read


def _alias(tensor: Any) -> np.ndarray | None:
    """A float32 view of ``tensor``'s own memory, if it has one."""
    if _is_torch(tensor):
        import torch

        if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
            return None
        if not tensor.is_contiguous():
            return None
        return tensor.detach().numpy().reshape(-1)
    if tensor.dtype == np.float32 and tensor.flags.c_contiguous and tensor.flags.writeable:
        return tensor.reshape(-1)
    return None


class FlatTensors:
    """Tensors averaged together, and their flat float32 view.

    Args:
        tensors: torch tensors or numpy arrays of floating dtype (any shapes, devices).

    Raises:
        ConfigError: no tensors, or a tensor that is not floating point.
    """

    def __init__(self, tensors: Sequence[Any]):
        self._tensors = list(tensors)
        if not self._tensors:
            raise ConfigError("tensors must not be empty")
        self._numels = [_check(t) for t in self._tensors]
        self.numel = sum(self._numels)
        alias = _alias(self._tensors[0]) if len(self._tensors) == 1 else None
        self.aliased = alias is not None
        self.flat: np.ndarray = alias if alias is not None else np.empty(self.numel, np.float32)

    @property
    def tensors(self) -> list[Any]:
        return list(self._tensors)

    def gather(self) -> None:
        """Copy the tensors' current values into :attr:`flat` (nothing to do when aliased)."""
        if self.aliased:
            return
        offset = 0
        for tensor, numel in zip(self._tensors, self._numels, strict=True):
            target = self.flat[offset : offset + numel]
            np.copyto(target, _numpy_view(tensor).reshape(-1))
            offset += numel

    def scatter(self) -> None:
        """Copy :attr:`flat` back into the tensors (nothing to do when aliased)."""
        if self.aliased:
            return
        offset = 0
        for tensor, numel in zip(self._tensors, self._numels, strict=True):
            source = self.flat[offset : offset + numel]
            if _is_torch(tensor) and not _numpy_readable(tensor):
                import torch

                with torch.no_grad():
                    tensor.copy_(torch.from_numpy(source).view(tensor.shape))
            else:
                target = _numpy_view(tensor)
                np.copyto(target, source.reshape(target.shape))
            offset += numel

    def all_finite(self) -> bool:
        """Whether every value of :attr:`flat` is finite."""
        step = 1 << 20  # bounds the temporary mask of the test
        return all(
            np.isfinite(self.flat[i : i + step]).all() for i in range(0, self.flat.size, step)
        )
