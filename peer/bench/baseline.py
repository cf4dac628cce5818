"""The plain single-process PyTorch loop that ``peer bench train`` compares peers against.

Same model, same data and the same total batch per optimizer step as the swarm: gradients of
``total_batch_size / task.batch_size`` micro-batches are accumulated (each loss divided by their
number, so the step sees the mean gradient over all its samples, as the collaborative
optimizer's sample-weighted average does) before one optimizer step. No phase clock, no hooks,
no mixed precision: this is what a PyTorch user would write.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterable

import torch

from peer.train.device import select_device, to_device, use_pinned_memory
from peer.train.tasks.base import DataShard, Task
from peer.train.trainer import evaluate

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class BaselineResult:
    """What the baseline achieved.

    Attributes:
        samples_per_s: samples processed per second of the measured wall time.
        final_loss: mean loss of the last ``final_loss_samples`` samples' micro-batches.
        num_samples: samples processed.
        num_optimizer_steps: optimizer steps taken.
        seconds: measured wall time (monotonic).
        eval_loss: the task's evaluation loss after training (None without an eval set).
        curve: (samples seen, mean loss of that optimizer step's micro-batches) per step, to
            compare with a run that saw a different number of samples.
    """

    samples_per_s: float
    final_loss: float
    num_samples: int
    num_optimizer_steps: int
    seconds: float
    curve: tuple[tuple[int, float], ...] = ()
    eval_loss: float | None = None

    def loss_at(self, num_samples: int, *, window_samples: int = 2048) -> float | None:
        """Mean step loss over the ``window_samples`` samples before ``num_samples`` had been
        seen (None if the baseline never got that far)."""
        if not self.curve or num_samples > self.curve[-1][0]:
            return None
        before = [(seen, loss) for seen, loss in self.curve if seen <= num_samples]
        window = [loss for seen, loss in before if seen > num_samples - window_samples]
        if not window:
            window = [before[-1][1]] if before else [self.curve[0][1]]
        return sum(window) / len(window)


def run_baseline(
    task: Task,
    *,
    seconds: float,
    num_threads: int,
    total_batch_size: int | None = None,
    make_optimizer: OptimizerFactory | None = None,
    shard: DataShard | None = None,
    final_loss_samples: int = 2048,
    device: str = "cpu",
    max_steps: int | None = None,
    lr_schedule: Callable[[int], float] | None = None,
) -> BaselineResult:
    """Train ``task`` in this process for ``seconds`` of wall time (or ``max_steps`` steps).

    Args:
        task: the task (its ``batch_size`` is the micro-batch).
        seconds: wall time to train for.
        num_threads: torch intra-op threads for the run (restored afterwards).
        total_batch_size: samples per optimizer step (a multiple of the micro-batch is exact;
            otherwise rounded up to whole micro-batches); None steps every micro-batch.
        make_optimizer: builds the optimizer (Adam, lr 1e-3 when None: the bench contract).
        shard: the data shard to read (shard 0 of 1, seed 0 when None).
        final_loss_samples: how many of the last samples the final loss averages over.
        device: where to train (``auto``: CUDA when present).
        max_steps: stop after this many optimizer steps instead, whatever the time.
        lr_schedule: optimizer step -> factor of the base LR (as the swarm's per epoch).
    """
    run = BaselineRun(
        task,
        num_threads=num_threads,
        total_batch_size=total_batch_size,
        make_optimizer=make_optimizer,
        shard=shard,
        final_loss_samples=final_loss_samples,
        device=device,
        lr_schedule=lr_schedule,
    )
    run.train(seconds=seconds, max_steps=max_steps)
    return run.result()


class BaselineRun:
    """The plain loop, trained in one stretch or several (``peer bench train`` runs one before
    and one after the swarm); the model, optimizer and data carry over between stretches.

    Args: as :func:`run_baseline`'s, less the stopping conditions (:meth:`train` takes them).
    """

    def __init__(
        self,
        task: Task,
        *,
        num_threads: int,
        total_batch_size: int | None = None,
        make_optimizer: OptimizerFactory | None = None,
        shard: DataShard | None = None,
        final_loss_samples: int = 2048,
        device: str = "cpu",
        lr_schedule: Callable[[int], float] | None = None,
    ):
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.task = task
        self.num_threads = num_threads
        self.num_micro_batches = max(
            1, math.ceil((total_batch_size or task.batch_size) / task.batch_size)
        )
        self.device = select_device(device)
        self.model = task.build_model().to(self.device)
        make_optimizer = make_optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
        self.optimizer = make_optimizer(self.model.parameters())
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self._lr_schedule = lr_schedule
        self._set_lr(0)
        self._batches = iter(
            task.make_loader(shard or DataShard(), pin_memory=use_pinned_memory(self.device))
        )
        window = max(1, math.ceil(final_loss_samples / task.batch_size))
        self._recent_losses: collections.deque[torch.Tensor] = collections.deque(maxlen=window)
        self._step_losses: list[torch.Tensor] = []
        self._curve_samples: list[int] = []
        self.num_samples = self.num_steps = self._micro = 0
        self.seconds = 0.0
        # (samples, seconds) of each stretch
        self.stretches: list[tuple[int, float]] = []

    def _set_lr(self, step: int) -> None:
        if self._lr_schedule is not None:
            for group, base_lr in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
                group["lr"] = base_lr * self._lr_schedule(step)

    def train(self, *, seconds: float = math.inf, max_steps: int | None = None) -> None:
        """Train for ``seconds`` of wall time, or until ``max_steps`` optimizer steps in all.

        Raises:
            ValueError: neither bound is finite, or ``seconds`` is not positive.
        """
        if not seconds > 0 or (seconds == math.inf and max_steps is None):
            raise ValueError(f"need seconds > 0 or max_steps, got {seconds}, {max_steps}")
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            first_samples = self.num_samples
            start = time.monotonic()
            self._loop(start + seconds, max_steps)
            elapsed_s = time.monotonic() - start
        finally:
            torch.set_num_threads(previous_threads)
        self.seconds += elapsed_s
        self.stretches.append((self.num_samples - first_samples, elapsed_s))

    def _loop(self, deadline: float, max_steps: int | None) -> None:
        # what a PyTorch user would write; the bookkeeping is what the peer's reports hold too
        model, optimizer, task, device = self.model, self.optimizer, self.task, self.device
        num_micro, recent_losses = self.num_micro_batches, self._recent_losses
        while time.monotonic() < deadline and (max_steps is None or self.num_steps < max_steps):
            inputs, targets = to_device(next(self._batches), device)
            loss = task.loss_fn(model(inputs), targets)
            (loss / num_micro).backward()
            recent_losses.append(loss.detach())
            self.num_samples += len(targets)
            self._micro += 1
            if self._micro == num_micro:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self.num_steps += 1
                self._micro = 0
                self._step_losses.append(torch.stack(list(recent_losses)[-num_micro:]).mean())
                self._curve_samples.append(self.num_samples)
                self._set_lr(self.num_steps)

    def result(self) -> BaselineResult:
        """What the stretches so far achieved (evaluates the model)."""
        losses = self._recent_losses
        return BaselineResult(
            samples_per_s=self.num_samples / self.seconds if self.seconds > 0 else 0.0,
            final_loss=float(torch.stack(list(losses)).mean()) if losses else math.nan,
            num_samples=self.num_samples,
            num_optimizer_steps=self.num_steps,
            seconds=self.seconds,
            curve=tuple(
                zip(self._curve_samples, torch.stack(self._step_losses).tolist(), strict=True)
            )
            if self._step_losses
            else (),
            eval_loss=evaluate(self.task, self.model, device=self.device),
        )
