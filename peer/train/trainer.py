"""The local training loop of a peer: data, forward, backward, then a pluggable step.

Each local step draws a batch (phase ``data``), copies it to the device (``h2d``; on CPU there is
no copy and no ``h2d`` boundary), runs the
forward pass and loss under autocast (``forward``), back-propagates the (scaled) loss
(``backward``), unscales and optionally clips the gradients, and hands them to a
:class:`StepHook` (``optimizer``). The default hook, :class:`LocalStep`, is a plain
``optimizer.step()``; the collaborative optimizer is another hook, which accumulates gradients
and steps when the swarm has reached its target batch size, marking its own ``matchmaking`` /
``allreduce`` phases on the same clock (nested phases take the time).

The phases of a step form one :meth:`~peer.profiling.phases.PhaseClock.sequence` (one clock boundary
between two phases). The loop adds a few tens of microseconds per step to a hand-written PyTorch
loop (``peer bench profiler`` measures it): no device synchronization, no ``.item()`` (reports
carry the loss as a tensor and convert on demand).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from peer.profiling.phases import PhaseClock, PhaseSequence
from peer.train.device import Amp, select_device, to_device, use_pinned_memory
from peer.train.tasks.base import Batch, DataShard, Task

logger = logging.getLogger(__name__)
START_METHODS = ("fork", "spawn", "forkserver")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Settings of the local loop.

    Attributes:
        device: ``auto`` (CUDA when present, else CPU) or a device name such as ``cpu``.
        amp: mixed precision on CUDA: ``auto``, ``bf16``, ``fp16`` or ``off`` (CPU: always off).
        num_workers: DataLoader worker processes (0 loads in the training thread).
        worker_start_method: how workers start: ``fork``, ``spawn``, ``forkserver``, or None
            for the platform default. Forking after the network thread started can deadlock
            in the child; start the loader first (:meth:`Trainer.start_data`) or use spawn.
        prefetch_factor: batches each worker loads ahead (None: PyTorch's default of 2).
        max_grad_norm: clip each step's gradient to this global L2 norm; None disables it.
    """

    device: str = "auto"
    amp: str = "auto"
    num_workers: int = 0
    worker_start_method: str | None = None
    prefetch_factor: int | None = None
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.worker_start_method not in (None, *START_METHODS):
            raise ValueError(
                f"worker_start_method must be one of {', '.join(START_METHODS)} or None, "
                f"got {self.worker_start_method!r}"
            )
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclasses.dataclass(slots=True)
class StepContext:
    """What a :class:`StepHook` gets after each backward pass.

    Attributes:
        step: local steps completed, this one included.
        batch_samples: samples in this step's batch.
        loss: this batch's loss, detached (a device tensor: reading it may synchronize).
        model: the model, whose ``.grad`` hold this step's unscaled (and clipped) gradients.
        optimizer: the local optimizer.
        amp: the precision helper; with an fp16 scaler, ``amp.step``/``amp.update`` must be
            called once per local step.
        clock: the phase clock, for the hook's own phases.
    """

    step: int
    batch_samples: int
    loss: torch.Tensor
    model: nn.Module
    optimizer: torch.optim.Optimizer
    amp: Amp
    clock: PhaseClock


class StepHook(Protocol):
    """Consumes each local step's gradients (steps, accumulates, averages, ...)."""

    def on_step(self, context: StepContext) -> None:
        """Use the gradients in ``context.model``, then leave them zeroed (or None)."""
        ...


@runtime_checkable
class WeightedBackward(Protocol):
    """A hook that wants each batch's loss multiplied by a weight before ``backward``.

    Lets a hook accumulate ``sum(batch_samples * mean_batch_gradient)`` in ``.grad`` through
    autograd's own in-place accumulation instead of an extra pass over the gradients per step.
    """

    def backward_weight(self, batch_samples: int) -> float:
        """The factor for this batch's loss (1.0: unchanged)."""
        ...


class LocalStep:
    """The default hook: one plain optimizer step per local step."""

    def on_step(self, context: StepContext) -> None:
        context.amp.step(context.optimizer)
        context.amp.update()
        context.optimizer.zero_grad(set_to_none=True)


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport:
    """One local step, as the ``on_step`` callback sees it.

    Attributes:
        step: local steps completed, this one included.
        samples: samples in this step's batch.
        total_samples: samples processed by this trainer, this batch included.
        loss_tensor: the batch's loss, detached, on the device.
    """

    step: int
    samples: int
    total_samples: int
    loss_tensor: torch.Tensor

    @property
    def loss(self) -> float:
        """The loss as a float (synchronizes with the GPU: read it only when needed)."""
        return float(self.loss_tensor)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Why and where :meth:`Trainer.run` stopped.

    Attributes:
        stopped_by: ``max_steps``, ``max_time``, ``stop_event`` or ``data_exhausted``.
        num_steps: local steps done in this call.
        num_samples: samples processed in this call.
        elapsed_s: monotonic seconds this call took.
        last_loss: the last step's loss, or None if no step ran.
    """

    stopped_by: str
    num_steps: int
    num_samples: int
    elapsed_s: float
    last_loss: float | None


class Trainer:
    """The local loop over one task, model and optimizer; see the module docstring.

    Args:
        task: where the data and loss come from.
        model: the model (moved to the device here; ``optimizer`` keeps referencing its
            parameters, which ``Module.to`` moves in place).
        optimizer: the local optimizer.
        shard: this peer's data shard.
        config: loop settings.
        clock: the phase clock to mark (a private one when None).
        hook: what to do with each step's gradients (:class:`LocalStep` when None).
    """

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        shard: DataShard,
        config: TrainerConfig | None = None,
        clock: PhaseClock | None = None,
        hook: StepHook | None = None,
    ):
        self.config = config or TrainerConfig()
        self.task = task
        self.shard = shard
        self.device = select_device(self.config.device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.amp = Amp(self.device, self.config.amp)
        self.clock = clock or PhaseClock()
        self.hook = hook or LocalStep()
        self.step = 0
        self.total_samples = 0
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        self._copies_to_device = self.device.type != "cpu"
        self._batches: Iterator[Batch] | None = None

    @property
    def hook(self) -> StepHook:
        """What each step's gradients go to."""
        return self._hook

    @hook.setter
    def hook(self, hook: StepHook) -> None:
        self._hook = hook
        self._weighted = isinstance(hook, WeightedBackward)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the loader's workers (if any); safe to call twice."""
        # Dropping the last reference to a DataLoader iterator shuts its workers down.
        self._batches = None

    def start_data(self) -> None:
        """Create the DataLoader iterator now (forks workers); ``run`` does it when needed."""
        if self._batches is not None:
            return
        config = self.config
        extra: dict[str, Any] = {}
        if config.num_workers > 0:
            extra["multiprocessing_context"] = config.worker_start_method
            extra["prefetch_factor"] = config.prefetch_factor
        loader = self.task.make_loader(
            self.shard,
            num_workers=config.num_workers,
            pin_memory=use_pinned_memory(self.device),
            **extra,
        )
        self._batches = iter(loader)

    def run(
        self,
        *,
        max_steps: int | None = None,
        max_time_s: float | None = None,
        stop_event: threading.Event | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        batches: Iterator[Batch] | None = None,
    ) -> RunResult:
        """Train until a stop condition holds (checked before each step).

        Args:
            max_steps: stop once :attr:`step` (counted over every call) reaches this.
            max_time_s: stop after this many monotonic seconds of this call.
            stop_event: stop when set (e.g. by the caller's Ctrl-C handler or the hook).
            on_step: called after every step with a :class:`StepReport`.
            batches: the batches to train on instead of the task's loader.
        """
        if batches is None:
            self.start_data()
            assert self._batches is not None
            batches = self._batches
        clock = self.clock
        start = time.monotonic()
        deadline = None if max_time_s is None else start + max_time_s
        first_step, first_samples = self.step, self.total_samples
        loss: torch.Tensor | None = None
        self.model.train()
        while True:
            stopped_by = self._stop_reason(max_steps, deadline, stop_event)
            if stopped_by is not None:
                break
            with clock.sequence("data") as phase:
                batch = next(batches, None)
                if batch is None:
                    stopped_by = "data_exhausted"
                    break
                report = self._step(batch, phase)
            loss = report.loss_tensor
            if on_step is not None:
                on_step(report)
        return RunResult(
            stopped_by=stopped_by,
            num_steps=self.step - first_step,
            num_samples=self.total_samples - first_samples,
            elapsed_s=time.monotonic() - start,
            last_loss=None if loss is None else float(loss),
        )

    def _stop_reason(
        self, max_steps: int | None, deadline: float | None, stop_event: threading.Event | None
    ) -> str | None:
        if max_steps is not None and self.step >= max_steps:
            return "max_steps"
        if deadline is not None and time.monotonic() >= deadline:
            return "max_time"
        if stop_event is not None and stop_event.is_set():
            return "stop_event"
        return None

    def _step(self, batch: Batch, phase: PhaseSequence) -> StepReport:
        # The phases follow each other in one sequence: a single clock boundary between two.
        # On CPU there is no copy to time (to_device returns the batch): no h2d boundary.
        if self._copies_to_device:
            phase.switch("h2d")
        inputs, targets = to_device(batch, self.device)
        phase.switch("forward")
        with self.amp.autocast():
            loss = self.task.loss_fn(self.model(inputs), targets)
        samples = len(targets)
        phase.switch("backward")
        if self._weighted:
            weight = self._hook.backward_weight(samples)
            self.amp.scale(loss * weight if weight != 1.0 else loss).backward()
        else:
            self.amp.scale(loss).backward()
        self.step += 1
        self.total_samples += samples
        loss = loss.detach()
        phase.switch("optimizer")
        self.amp.unscale_(self.optimizer)
        if self.config.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self._parameters, self.config.max_grad_norm)
        context = StepContext(
            self.step, samples, loss, self.model, self.optimizer, self.amp, self.clock
        )
        self._hook.on_step(context)
        return StepReport(self.step, samples, self.total_samples, loss)


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, *, device: torch.device | None = None) -> float | None:
    """Mean loss of ``model`` over the task's evaluation set (None if the task has none).

    The model is put in eval mode for the pass and its previous mode restored.
    """
    if task.eval_batches is None:
        return None
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for batch in task.eval_batches():
            inputs, targets = to_device(batch, device)
            total += float(task.loss_fn(model(inputs), targets)) * len(targets)
            count += len(targets)
    finally:
        model.train(was_training)
    return total / count if count else None
