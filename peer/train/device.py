"""Where the model runs and how: device choice, mixed precision, host-to-device copies.

Every GPU path is guarded, so all of it runs (as cheap no-ops) on a CPU-only machine. On CUDA,
``amp="auto"`` picks bfloat16 autocast where the GPU supports it (no loss scaling needed: bf16
has float32's range) and float16 autocast with a GradScaler otherwise. On CPU, autocast is off:
CPU bf16 autocast is usually slower than float32 for the small models peers train.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)
AMP_MODES = ("auto", "bf16", "fp16", "off")


def select_device(override: str | None = None) -> torch.device:
    """The device to train on: ``override`` when given (``"cpu"``, ``"cuda:1"``), else CUDA
    when present, else CPU.

    Raises:
        ValueError: the override is not a device name, or names CUDA on a machine without it.
    """
    if override is None or override == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(override)
    except RuntimeError as e:
        raise ValueError(f"device {override!r} is not a device name: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {override!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {override!r}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
    return device


class Amp:
    """Autocast and loss scaling for one device; every method is a no-op where AMP is off.

    Typical step::

        with amp.autocast():
            loss = loss_fn(model(inputs), targets)
        amp.scale(loss).backward()
        amp.unscale_(optimizer)      # before clipping or reading gradients
        amp.step(optimizer)          # skips the step if fp16 gradients overflowed
        amp.update()

    Args:
        device: the training device.
        mode: ``auto`` (bf16 if supported, else fp16; CUDA only), ``bf16``, ``fp16`` or ``off``.
    """

    def __init__(self, device: torch.device, mode: str = "auto"):
        if mode not in AMP_MODES:
            raise ValueError(f"amp must be one of {', '.join(AMP_MODES)}, got {mode!r}")
        self.device = device
        self.dtype: torch.dtype | None = None
        if device.type == "cuda" and mode != "off":
            if mode == "auto":
                mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
            self.dtype = torch.bfloat16 if mode == "bf16" else torch.float16
        self.scaler: torch.amp.GradScaler | None = None
        if self.dtype is torch.float16:
            self.scaler = torch.amp.GradScaler("cuda")
        self._off = contextlib.nullcontext()
        if device.type == "cuda":
            scaling = "on" if self.scaler else "off"
            logger.info("autocast on %s: %s, loss scaling %s", device, self.dtype, scaling)

    @property
    def enabled(self) -> bool:
        """Whether autocast is on."""
        return self.dtype is not None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context that runs the forward pass (and loss) in reduced precision, if enabled."""
        if self.dtype is None:
            return self._off
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (scaled with fp16, else the loss itself)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place (once per step, before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, skipped by the scaler when fp16 gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)

    def update(self) -> None:
        """Adjust the loss scale after a step (no-op without a scaler)."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints (empty without a scaler)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def use_pinned_memory(device: torch.device) -> bool:
    """Pinned host memory speeds up (and allows async) copies to a GPU; useless on CPU."""
    return device.type == "cuda"


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch (tensors in tuples, lists, dicts) to ``device``.

    On CPU the batch is returned as it is. On CUDA copies are non-blocking; they are
    asynchronous when the loader pinned the memory, and kernels that use them are ordered after
    them on the same stream, so no synchronization is needed.
    """
    if device.type == "cpu":
        return batch
    return _move(batch, device)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, tuple):
        moved = [_move(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def device_synchronize(device: torch.device) -> Callable[[], None] | None:
    """A callable that waits for the device's queued work (None on CPU, where there is none)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)
