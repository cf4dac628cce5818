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

from peer.device import select_device, to_device, use_pinned_memory
from peer.tasks.base import DataShard, Task
from peer.trainer import evaluate

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
    if seconds <= 0 or num_threads < 1:
        raise ValueError(f"need seconds > 0 and num_threads >= 1, got {seconds}, {num_threads}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return _train(
            task,
            seconds,
            max(1, math.ceil((total_batch_size or task.batch_size) / task.batch_size)),
            make_optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3)),
            shard or DataShard(),
            max(1, math.ceil(final_loss_samples / task.batch_size)),
            select_device(device),
            max_steps,
            lr_schedule,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _train(
    task: Task,
    seconds: float,
    num_micro_batches: int,
    make_optimizer: OptimizerFactory,
    shard: DataShard,
    loss_window: int,
    device: torch.device,
    max_steps: int | None,
    lr_schedule: Callable[[int], float] | None,
) -> BaselineResult:
    model = task.build_model().to(device)
    optimizer = make_optimizer(model.parameters())
    base_lrs = [group["lr"] for group in optimizer.param_groups]

    def set_lr(step: int) -> None:
        if lr_schedule is not None:
            for group, base_lr in zip(optimizer.param_groups, base_lrs, strict=True):
                group["lr"] = base_lr * lr_schedule(step)

    set_lr(0)
    batches = iter(task.make_loader(shard, pin_memory=use_pinned_memory(device)))
    recent_losses: collections.deque[torch.Tensor] = collections.deque(maxlen=loss_window)
    step_losses: list[torch.Tensor] = []
    curve_samples: list[int] = []
    num_samples = num_steps = micro = 0
    start = time.monotonic()
    deadline = start + seconds if max_steps is None else math.inf
    while time.monotonic() < deadline and (max_steps is None or num_steps < max_steps):
        inputs, targets = to_device(next(batches), device)
        loss = task.loss_fn(model(inputs), targets)
        (loss / num_micro_batches).backward()
        recent_losses.append(loss.detach())
        num_samples += len(targets)
        micro += 1
        if micro == num_micro_batches:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            num_steps += 1
            micro = 0
            step_losses.append(torch.stack(list(recent_losses)[-num_micro_batches:]).mean())
            curve_samples.append(num_samples)
            set_lr(num_steps)
    elapsed_s = time.monotonic() - start
    return BaselineResult(
        samples_per_s=num_samples / elapsed_s,
        final_loss=float(torch.stack(list(recent_losses)).mean()) if recent_losses else math.nan,
        num_samples=num_samples,
        num_optimizer_steps=num_steps,
        seconds=elapsed_s,
        curve=tuple(zip(curve_samples, torch.stack(step_losses).tolist(), strict=True))
        if step_losses
        else (),
        eval_loss=evaluate(task, model, device=device),
    )
