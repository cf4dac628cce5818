"""Learning-rate schedules as functions of the swarm's epoch (global, not local steps).

A schedule maps an epoch to a factor of the optimizer's base learning rate. Being a function of
the epoch alone (no scheduler state), it stays right when a peer jumps epochs: a state download,
a resume from a checkpoint, a newcomer joining at epoch 500.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from dht.errors import ConfigError

ScheduleName = Literal["constant", "linear", "cosine"]
LRSchedule = Callable[[int], float]


def make_lr_schedule(
    name: ScheduleName,
    *,
    warmup_epochs: int = 0,
    total_epochs: int | None = None,
    min_lr_ratio: float = 0.0,
) -> LRSchedule | None:
    """The factor of the base LR at each epoch, or None for a constant LR without warmup.

    Args:
        name: ``constant`` (after warmup), ``linear`` or ``cosine`` decay to ``min_lr_ratio``
            at ``total_epochs`` (and flat after it).
        warmup_epochs: epochs of linear warmup from ``1 / (warmup_epochs + 1)`` to 1.
        total_epochs: the epoch where decay ends; required by ``linear`` and ``cosine``.
        min_lr_ratio: the final factor of the decaying schedules, in [0, 1].

    Raises:
        ConfigError: inconsistent arguments (the message names the option).
    """
    if warmup_epochs < 0:
        raise ConfigError(f"--warmup-epochs must be >= 0, got {warmup_epochs}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {min_lr_ratio}")
    if name == "constant":
        if warmup_epochs == 0:
            return None
        return lambda epoch: _warmup(epoch, warmup_epochs) or 1.0
    if total_epochs is None or total_epochs <= warmup_epochs:
        raise ConfigError(
            f"--lr-schedule {name} needs --schedule-epochs (or --max-epochs) above the warmup"
        )

    def decay(epoch: int) -> float:
        warm = _warmup(epoch, warmup_epochs)
        if warm is not None:
            return warm
        progress = min(1.0, (epoch - warmup_epochs) / (total_epochs - warmup_epochs))
        shape = 1.0 - progress if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return decay


def _warmup(epoch: int, warmup_epochs: int) -> float | None:
    if epoch < warmup_epochs:
        return (epoch + 1) / (warmup_epochs + 1)
    return None
