"""One ``peer bench train`` run's settings (:class:`TrainBenchConfig`, the benchmark contract's
defaults) and the bounds on its windows; the run itself is :mod:`peer.bench.train`."""

from __future__ import annotations

import dataclasses
import math
import os

# The longest window. The swarm is paused for up to two of the baseline's windows in a row (A B
# B A A B ...): that must stay under the waits no floor raises (an RPC's 5 s, the DHT records'
# 20-s lifetime).
MAX_WINDOW_S = 2.0
# Seconds above the longest pause that the peers' adaptive waits are floored at (see
# ``pause_floor_s``): the loop's own wake-up after SIGCONT, and the bench reading metrics.
PAUSE_MARGIN_S = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """One ``peer bench train`` run; the defaults are the benchmark contract.

    Attributes:
        backend: ``native`` or ``hivemind``.
        num_peers: peer processes.
        task: task name (``synthetic``, ``charlm``, or ``package.module:function``).
        task_options: extra task options (``KEY=VALUE``), e.g. ``path=...`` for charlm.
        seconds: training seconds, for the baseline and for the swarm each.
        batch_size: samples per local step (None: the task's default, 32 for synthetic).
        target_batch_size: samples per optimizer step, in the swarm and in the baseline.
        lr: Adam's learning rate.
        mode: ``grad``, ``params`` or ``diloco``.
        delay_update: the peers' ``--delay-update`` (``grad`` mode, native backend): each
            round runs while the next epoch computes, its result applied one epoch late.
        num_threads: the machine's cores to use (baseline threads; peers split them).
        run_baseline: whether to run the baseline (its fields are null otherwise).
        epochs: train this many optimizer steps (swarm epochs) instead of ``seconds``: for
            statistical efficiency, compared through ``eval_loss`` at the end.
        lr_schedule, warmup_epochs, min_lr_ratio: the LR schedule over epochs (baseline: over
            its optimizer steps), as ``peer join`` takes them.
        timeout_s: bound on the whole swarm run in ``epochs`` mode.
        window_s: seconds of each measured window when the baseline and the swarm take turns
            (``seconds`` of each side are split into about ``seconds / window_s`` pairs, at
            least 2, of windows of at most ``MAX_WINDOW_S``).
        baseline: the plain loops the windows compare with: ``matched``, one per peer with
            that peer's torch threads and data seed (their rates summed: what the swarm's
            machinery costs, with the machine's own response to a thread count alike on both
            sides); ``single``, one loop with all the cores and seed 0 (what N peers on this
            machine lose against training alone on it). The same with one peer. ``epochs``
            mode always trains one loop.
    """

    backend: str = "native"
    num_peers: int = 2
    task: str = "synthetic"
    task_options: tuple[str, ...] = ()
    seconds: float = 40.0
    batch_size: int | None = None
    target_batch_size: int = 2048
    lr: float = 1e-3
    mode: str = "grad"
    delay_update: bool = False
    num_threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    run_baseline: bool = True
    epochs: int | None = None
    lr_schedule: str = "constant"
    warmup_epochs: int = 0
    min_lr_ratio: float = 0.0
    timeout_s: float = 3600.0
    window_s: float = 1.0
    baseline: str = "matched"

    def __post_init__(self) -> None:
        for name in ("num_peers", "target_batch_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.seconds > 0 or not self.lr > 0:
            raise ValueError("seconds and lr must be > 0")
        if self.baseline not in ("matched", "single"):
            raise ValueError(f"baseline must be matched or single, got {self.baseline!r}")
        if self.delay_update and (self.mode != "grad" or self.backend != "native"):
            raise ValueError("delay_update needs mode grad and the native backend")
        if not 0 < self.window_s <= MAX_WINDOW_S:
            raise ValueError(f"window_s must be in (0, {MAX_WINDOW_S}], got {self.window_s}")

    def windows(self) -> tuple[int, float]:
        """The number of pairs of windows and each window's seconds."""
        num_pairs = max(2, round(self.seconds / self.window_s))
        num_pairs = max(num_pairs, math.ceil(self.seconds / MAX_WINDOW_S))
        return num_pairs, self.seconds / num_pairs

    def pause_floor_s(self) -> float:
        """The floor of the peers' adaptive waits in interleaved windows (``--min-deadline``):
        above the longest pause, two windows, so that no wait begun just before a pause runs
        out during it (a loopback swarm's own waits are far shorter, and fire only when a peer
        fails, which none does in the bench)."""
        return 2 * self.windows()[1] + PAUSE_MARGIN_S

    def all_task_options(self) -> list[str]:
        options = list(self.task_options)
        if self.batch_size is not None:
            options.append(f"batch_size={self.batch_size}")
        return options
