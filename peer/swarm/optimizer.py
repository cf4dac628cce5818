"""The collaborative optimizer: a :class:`peer.train.trainer.StepHook` that turns local steps into
swarm epochs.

Modes (``CollaborativeConfig.mode``):

* ``grad``: gradients accumulate locally, weighted by batch size; when the swarm has gathered
  ``target_batch_size`` samples, the peers average their mean gradients weighted by the samples
  each contributed (so the result is the gradient of the union of everyone's batches), the local
  optimizer steps once, and the epoch advances.
* ``params``: the optimizer steps on every local batch; at each epoch boundary the parameters
  are averaged (weighted by samples).
* ``grad`` with ``delay_update``: the round of epoch t runs in the background while the peer
  computes epoch t+1 (on the parameters before t's step); the averaged gradient is applied as
  soon as the round ends, mid-epoch. Staleness: at most one optimizer step, as in hivemind's
  delayed parameter updates; the all-reduce costs no compute time unless it takes longer than
  an epoch (then the next boundary waits for it, charged to ``allreduce``).
* ``diloco``: the inner optimizer steps locally; at each epoch boundary the peers average the
  pseudo-gradient (parameters at the start of the epoch minus now), parameters go back to the
  start of the epoch, and an outer optimizer (SGD with Nesterov momentum) applies the average.

A round that fails (no group, a timeout) is an expected outcome: the peer steps on its own
contribution, counts it and logs one WARNING line; the next parameter sync brings it back in
line. The learning rate follows the swarm's epoch (``lr_schedule``), not local steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from dht.errors import ConfigError
from peer.swarm.estimate_gate import EstimateGate
from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.progress import GlobalProgress
from peer.swarm.round import (
    EpochStats,
    PendingRound,
    ProgressSource,
    RoundOutcome,
    TensorAverager,
)
from peer.train.trainer import StepContext

logger = logging.getLogger(__name__)
Mode = Literal["grad", "params", "diloco"]


@dataclass(frozen=True, kw_only=True)
class CollaborativeConfig:
    """How local steps become swarm epochs.

    Attributes:
        mode: ``grad``, ``params`` or ``diloco`` (see the module docstring).
        target_batch_size: samples the swarm gathers per epoch.
        averaging_timeout_s: bound on one round (matchmaking and all-reduce), in seconds.
        outer_lr: learning rate of the outer optimizer (``diloco``).
        outer_momentum: Nesterov momentum of the outer optimizer (``diloco``).
        accumulate_in_grad: in ``grad`` mode, let autograd accumulate straight into the
            averaged buffers (each loss weighted by its batch size; no extra pass over the
            gradients per step). Needs gradients that are not rescaled or clipped per local
            step: turn it off with fp16 loss scaling or ``max_grad_norm``.
        delay_update: overlap each round with the next epoch's compute (``grad`` mode; see the
            module docstring for the staleness).
    """

    mode: Mode = "grad"
    target_batch_size: int
    averaging_timeout_s: float = 30.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    accumulate_in_grad: bool = True
    delay_update: bool = False

    def __post_init__(self) -> None:
        if self.delay_update and self.mode != "grad":
            raise ConfigError("delay_update needs mode grad")
        if self.mode not in ("grad", "params", "diloco"):
            raise ConfigError(f"mode must be grad, params or diloco, got {self.mode!r}")
        if self.target_batch_size < 1:
            raise ConfigError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        for name in ("averaging_timeout_s", "outer_lr", "outer_momentum"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


def averaged_buffers(params: list[torch.Tensor], mode: Mode) -> list[torch.Tensor]:
    """The tensors a round averages, fixed for the optimizer's life: gradient accumulators
    (``grad``), the parameters themselves (``params``) or pseudo-gradients (``diloco``)."""
    if mode == "params":
        return [p.data for p in params]
    return [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]


class CollaborativeOptimizer:
    """The hook the trainer calls after every backward pass; see the module docstring.

    Args:
        model: the model being trained (its parameters are what is averaged).
        optimizer: the local (inner, in ``diloco``) optimizer.
        averager: averages tensors with a group of the swarm.
        progress: the progress tracker (reports local samples, estimates the swarm's).
        config: mode, target batch size and timeouts.
        lr_schedule: epoch -> factor of each param group's base LR (see
            :mod:`peer.train.schedules`), applied whenever the epoch changes; None keeps the LR.
        on_epoch: called with the new epoch after every epoch boundary (state serving,
            checkpoints, metrics).
        epoch: the epoch to start at (after a state download or a checkpoint).
        buffers: the averaged tensors, when the caller built them first (with
            :func:`averaged_buffers`) to hand them to the averager.
        on_behind: called with the swarm's epoch when it is ahead of this peer's; loads the
            swarm's state and returns the epoch now reached (this peer's own if it failed).
        newcomer_hold: when alone at its epoch, hold the boundary for a peer catching up
            (:mod:`peer.swarm.newcomer_hold`); None never holds.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        averager: TensorAverager,
        progress: ProgressSource,
        config: CollaborativeConfig,
        lr_schedule: Callable[[int], float] | None = None,
        on_epoch: Callable[[int], None] | None = None,
        epoch: int = 0,
        buffers: list[torch.Tensor] | None = None,
        on_behind: Callable[[int], int] | None = None,
        newcomer_hold: NewcomerHold | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.averager = averager
        self.progress = progress
        self.config = config
        self.lr_schedule = lr_schedule
        self.on_epoch = on_epoch
        self.epoch = epoch
        self.samples = 0
        self.stats = EpochStats()
        self.on_behind = on_behind
        self.newcomer_hold = newcomer_hold
        self._gate = EstimateGate()
        self._alone = False
        self._num_at_epoch = 1
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = (
            buffers if buffers is not None else averaged_buffers(self._params, config.mode)
        )
        self._start_params: list[torch.Tensor] | None = None
        self._outer: torch.optim.Optimizer | None = None
        self._in_grad = config.mode == "grad" and config.accumulate_in_grad
        # The accumulated gradients hold sum(batch_samples * mean gradient) / _sample_unit
        # (the first batch's size with autograd accumulating, else 1).
        self._sample_unit = 1.0
        self._unit_fixed = not self._in_grad
        # with delayed updates the averager's buffers are busy during the next epoch, so
        # gradients accumulate elsewhere
        self._accumulators = (
            averaged_buffers(self._params, "grad") if config.delay_update else self.buffers
        )
        self._pending: PendingRound | None = None
        self._pending_epoch = 0
        self._clock = None
        if self._in_grad:
            self._attach_buffers()
        if config.mode == "diloco":
            self._start_params = [p.detach().clone() for p in self._params]
            self._outer = torch.optim.SGD(
                self._params, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True
            )
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self._apply_lr()

    def _apply_lr(self) -> None:
        if self.lr_schedule is None:
            return
        factor = self.lr_schedule(self.epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    # ---- the hook ----------------------------------------------------------------------------

    def _attach_buffers(self) -> None:
        # autograd adds into an existing .grad in place, so the buffers the averager holds
        # receive every backward pass directly
        for param, accumulator in zip(self._params, self._accumulators, strict=True):
            param.grad = accumulator

    def backward_weight(self, batch_samples: int) -> float:
        """Weight each loss by its batch size, in units of the first batch's size, when
        autograd accumulates into the buffers: batches of the usual size get weight 1, which
        costs no extra multiplication in the graph (the trainer skips it)."""
        if not self._in_grad:
            return 1.0
        if not self._unit_fixed:
            self._sample_unit, self._unit_fixed = float(batch_samples), True
        return batch_samples / self._sample_unit

    def on_step(self, context: StepContext) -> None:
        if self._in_grad:
            pass  # backward already added batch_samples * gradient into the buffers
        elif self.config.mode == "grad":
            self._accumulate(context.batch_samples)
        else:
            context.amp.step(self.optimizer)
            context.amp.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.samples += context.batch_samples
        self._clock = context.clock
        if self._pending is not None and self._pending.done():
            self.flush()
        if not self._gate.due(self.progress.version, self.samples):
            return  # the tracker hears of these samples with the next estimate
        self.progress.report_local_progress(self.epoch, self.samples)
        swarm = self.progress.current()
        if self.on_behind is not None and self._behind(swarm):
            self._catch_up(swarm.epoch)
        elif self._swarm_ready(swarm, context.batch_samples):
            self.finish_epoch(context)
        elif self._alone:  # counted by _swarm_ready: the estimate is this peer's samples
            missing = swarm.target_batch_size - swarm.samples_accumulated
            self._gate.checked_alone(ready_at_samples=self.samples + missing)
        else:
            own_rate = swarm.peers[0].samples_per_s if swarm.peers else 0.0
            step_s = context.batch_samples / own_rate if own_rate > 0 else 0.0
            self._gate.checked(eta_s=swarm.eta_next_epoch_s, step_s=step_s)

    def _behind(self, swarm: GlobalProgress) -> bool:
        """Whether to load the swarm's state: more than one epoch behind, or one behind with
        nobody left at this epoch (its round is over; stepping alone would leave this peer's
        parameters apart from everyone's for good in ``grad`` mode). One behind with others
        here: finish the epoch with them (see ``_swarm_ready``)."""
        if swarm.epoch <= self.epoch:
            return False
        if swarm.epoch > self.epoch + 1:
            return True
        self._count_at_epoch(swarm)
        return self._alone

    def _catch_up(self, swarm_epoch: int) -> None:
        self.flush()
        reached = self.on_behind(swarm_epoch)
        if reached > self.epoch:  # the downloaded state replaces what was accumulated
            self.epoch, self.samples = reached, 0
            self._gate.reset()
            self._apply_lr()
            if self.config.mode == "grad":
                for accumulator in self._accumulators:
                    accumulator.zero_()
            elif self.config.mode == "diloco":
                assert self._start_params is not None
                for start, param in zip(self._start_params, self._params, strict=True):
                    start.copy_(param.detach())
            self.progress.report_local_progress(self.epoch, 0)

    def _accumulate(self, batch_samples: int) -> None:
        for accumulator, param in zip(self._accumulators, self._params, strict=True):
            if param.grad is not None:
                accumulator.add_(param.grad, alpha=batch_samples)
                param.grad = None

    def _swarm_ready(self, swarm: GlobalProgress, batch_samples: int = 0) -> bool:
        """Whether to end the epoch now: the swarm reached its target, or will be nearer to it
        now than after this peer's next local step (half a step's worth of the swarm's samples
        is missing at most), so that epochs hold the target on average."""
        self._count_at_epoch(swarm)
        if swarm.epoch > self.epoch:
            return True  # the swarm moved on: average what we have, or fall back and resync
        if swarm.ready and self._alone and self.newcomer_hold is not None:
            return not self.newcomer_hold.should_hold(swarm, self.epoch)
        if swarm.ready or self._alone or self.samples == 0:
            return swarm.ready
        own_rate = swarm.peers[0].samples_per_s if swarm.peers else 0.0
        step_s = batch_samples / own_rate if own_rate > 0 else 0.0
        return swarm.eta_next_epoch_s <= 0.5 * step_s

    def _count_at_epoch(self, swarm: GlobalProgress) -> None:
        # nobody else at this epoch: a round would only wait out matchmaking for a group of one
        self._num_at_epoch = sum(peer.epoch == self.epoch for peer in swarm.peers)
        self._alone = self._num_at_epoch <= 1

    # ---- epoch boundary ----------------------------------------------------------------------

    def finish_epoch(self, context: StepContext) -> RoundOutcome | None:
        """Average with the swarm and apply the result; advances the epoch.

        Returns the round's outcome, or None when the round goes on in the background.
        """
        self._clock = context.clock
        if self._pending is not None:  # at most one round in flight: apply the previous first
            self.flush()
            self._count_at_epoch(self.progress.current())  # who is at this epoch, after it
        tensors = self._round_tensors()
        if self.config.delay_update and not self._alone:
            self._pending = self.averager.start_average(
                tensors,
                weight=float(self.samples),
                epoch=self.epoch,
                timeout_s=self.config.averaging_timeout_s,
                expected_peers=self._num_at_epoch,
            )
            self._pending_epoch = self.epoch
            self._next_epoch()
            return None
        if self._alone:  # nobody else in the swarm: no matchmaking wait for a group of one
            outcome = RoundOutcome(
                ok=True, num_peers=1, reason="alone", epoch=self.epoch, status="alone"
            )
        else:
            outcome = self.averager.average(
                tensors,
                weight=float(self.samples),
                epoch=self.epoch,
                timeout_s=self.config.averaging_timeout_s,
                expected_peers=self._num_at_epoch,
            )
        self._record(outcome)
        self.stats.epoch_samples = [*self.stats.epoch_samples[-999:], self.samples]
        with context.clock.phase("optimizer"):
            self._apply(tensors)
        self._next_epoch()
        if outcome.ok and outcome.members:
            self.progress.note_round(self.epoch, outcome.members)
        return outcome

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.samples = 0
        self._gate.reset()
        if self.newcomer_hold is not None:
            self.newcomer_hold.reset()
        self._apply_lr()
        self.progress.report_local_progress(self.epoch, 0)
        if self.on_epoch is not None:
            self.on_epoch(self.epoch)

    def flush(self) -> None:
        """Wait for the round in the background, if any, and apply its result."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        outcome = pending.wait()
        self._record(outcome)
        with self._clock.phase("optimizer"):
            self._apply(self.buffers)
        if outcome.ok and outcome.members:  # they entered the next epoch with this peer
            self.progress.note_round(self._pending_epoch + 1, outcome.members)

    def _round_tensors(self) -> list[torch.Tensor]:
        """Fill the averaged buffers with this peer's contribution to the round."""
        mode = self.config.mode
        if mode == "grad" and self.samples:
            units = self.samples / self._sample_unit
            if self._accumulators is not self.buffers:
                for buffer, accumulator in zip(self.buffers, self._accumulators, strict=True):
                    torch.div(accumulator, units, out=buffer)
                    accumulator.zero_()
            else:
                for accumulator in self.buffers:
                    accumulator.div_(units)
        elif mode == "diloco":
            assert self._start_params is not None
            with torch.no_grad():
                for buffer, start, param in zip(
                    self.buffers, self._start_params, self._params, strict=True
                ):
                    torch.sub(start, param, out=buffer)
        return self.buffers

    def _apply(self, tensors: list[torch.Tensor]) -> None:
        mode = self.config.mode
        if mode == "grad":
            for param, average in zip(self._params, tensors, strict=True):
                param.grad = average.to(param.dtype)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for average in tensors:
                average.zero_()
            if self._in_grad:
                self._attach_buffers()
        elif mode == "diloco":
            assert self._start_params is not None and self._outer is not None
            with torch.no_grad():
                for param, start, pseudo_grad in zip(
                    self._params, self._start_params, tensors, strict=True
                ):
                    param.copy_(start)
                    param.grad = pseudo_grad
            self._outer.step()
            self._outer.zero_grad(set_to_none=True)
            for start, param in zip(self._start_params, self._params, strict=True):
                start.copy_(param.detach())

    def _record(self, outcome: RoundOutcome) -> None:
        stats = self.stats
        stats.num_rounds += 1
        stats.last_group_size = outcome.num_peers
        stats.last_reason = outcome.reason
        stats.history = [*stats.history[-99:], outcome]
        stats.matchmaking_s += outcome.matchmaking_s
        stats.allreduce_s += outcome.allreduce_s
        if not outcome.ok:
            stats.num_failed_rounds += 1
            logger.warning(
                "epoch %d: averaging failed (%s); stepping on local data",
                self.epoch,
                outcome.reason,
            )
        elif outcome.num_peers <= 1:
            stats.num_alone += 1
