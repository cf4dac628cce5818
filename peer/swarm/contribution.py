"""What one peer brings to a round and how the group's average comes back, per mode.

:class:`Contribution` owns the averaged buffers (fixed for the peer's life, so the averager is
built over them once) and everything that depends on the mode:

* ``grad``: sample-weighted gradients accumulate (autograd adds straight into the buffers when
  ``accumulate_in_grad``); the round averages their mean; the local optimizer steps on it.
* ``params``: the buffers are the parameters themselves; the optimizer steps every batch.
* ``diloco``: the buffers hold the pseudo-gradient (parameters at the epoch's start minus now);
  the outer optimizer (SGD, Nesterov momentum) applies the average (:mod:`peer.swarm.diloco`,
  blocking or one round late).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch
from torch import nn

from peer.swarm.diloco import OuterStep

Mode = Literal["grad", "params", "diloco"]


def averaged_buffers(params: list[torch.Tensor], mode: Mode) -> list[torch.Tensor]:
    """The tensors a round averages, fixed for the optimizer's life: gradient accumulators
    (``grad``), the parameters themselves (``params``) or pseudo-gradients (``diloco``)."""
    if mode == "params":
        return [p.data for p in params]
    return [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]


class Contribution:
    """The averaged buffers of one peer and the mode's arithmetic on them.

    Args:
        model: the model trained (its trainable parameters are what the modes act on).
        optimizer: the local (inner, in ``diloco``) optimizer.
        mode: ``grad``, ``params`` or ``diloco``.
        accumulate_in_grad: in ``grad`` mode, autograd accumulates into the buffers.
        separate_accumulators: gradients accumulate apart from the buffers (delayed updates:
            the buffers are busy in a round during the next epoch).
        outer_lr, outer_momentum: the outer optimizer's settings (``diloco``).
        diloco_overlap: apply each average one round late, the inner steps going on meanwhile
            (``diloco``; :mod:`peer.swarm.diloco`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        mode: Mode,
        accumulate_in_grad: bool,
        separate_accumulators: bool = False,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        diloco_overlap: bool = False,
    ):
        self.mode = mode
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = averaged_buffers(self.params, mode)
        self.in_grad = mode == "grad" and accumulate_in_grad
        # The accumulated gradients hold sum(batch_samples * mean gradient) / _sample_unit
        # (the first batch's size with autograd accumulating, else 1).
        self._sample_unit = 1.0
        self._unit_fixed = not self.in_grad
        self._accumulators = (
            averaged_buffers(self.params, "grad") if separate_accumulators else self.buffers
        )
        self.outer: OuterStep | None = None
        if mode == "diloco":
            self.outer = OuterStep(
                self.params,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                overlap=diloco_overlap,
            )
        if self.in_grad:
            self._attach()

    def _attach(self) -> None:
        # autograd adds into an existing .grad in place, so the buffers the averager holds
        # receive every backward pass directly
        for param, accumulator in zip(self.params, self._accumulators, strict=True):
            param.grad = accumulator

    def backward_weight(self, batch_samples: int) -> float:
        """The factor of a batch's loss: its size in units of the first batch's size when
        autograd accumulates into the buffers (usual batches get 1: no extra multiplication)."""
        if not self.in_grad:
            return 1.0
        if not self._unit_fixed:
            self._sample_unit, self._unit_fixed = float(batch_samples), True
        return batch_samples / self._sample_unit

    @property
    def sample_unit(self) -> float:
        """The batch size that weighs 1 when autograd accumulates (the first batch's)."""
        return self._sample_unit

    def add_batch(self, batch_samples: int, step_local) -> None:
        """Take one local batch's gradient (``step_local()`` steps the local optimizer)."""
        if self.in_grad:
            return  # backward already added batch_samples * gradient into the buffers
        if self.mode == "grad":
            for accumulator, param in zip(self._accumulators, self.params, strict=True):
                if param.grad is not None:
                    accumulator.add_(param.grad, alpha=batch_samples)
                    param.grad = None
        else:
            step_local()

    def prepare(self, samples: int) -> list[torch.Tensor]:
        """Fill the buffers with this peer's share of the round (over ``samples`` samples)."""
        if self.mode == "grad" and samples:
            units = samples / self._sample_unit
            if self._accumulators is not self.buffers:
                for buffer, accumulator in zip(self.buffers, self._accumulators, strict=True):
                    torch.div(accumulator, units, out=buffer)
                    accumulator.zero_()
            else:
                for accumulator in self.buffers:
                    accumulator.div_(units)
        elif self.mode == "diloco":
            self.outer.prepare(self.buffers)
        return self.buffers

    def apply(self) -> None:
        """Step on the buffers, which now hold the group's average (or this peer's own share)."""
        if self.mode == "grad":
            for param, average in zip(self.params, self.buffers, strict=True):
                param.grad = average.to(param.dtype)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for average in self.buffers:
                average.zero_()
            if self.in_grad:
                self._attach()
        elif self.mode == "diloco":
            self.outer.apply(self.buffers)

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The outer optimizer (``diloco``; None otherwise): its momentum is part of the state
        peers share, served and re-synced with the model (:mod:`peer.swarm.catch_up`)."""
        return self.outer.optimizer if self.outer is not None else None

    def discard(self) -> None:
        """Drop what was gathered (a downloaded state replaces it)."""
        if self.mode == "grad":
            for accumulator in self._accumulators:
                accumulator.zero_()
        elif self.mode == "diloco":
            self.outer.restart()

    def replica_in_model(self) -> AbstractContextManager[None]:
        """Within: the model holds the replica the swarm agrees on (overlapped DiLoCo's ``g``;
        the model itself in every other case)."""
        return self.outer.replica_in_model() if self.outer is not None else nullcontext()
