"""How local steps become swarm epochs: :class:`CollaborativeConfig`, the collaborative
optimizer's settings (the modes are described in :mod:`peer.swarm.optimizer`), and the averaged
buffers it builds from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dht.errors import ConfigError
from peer.swarm.contribution import Contribution, Mode


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
        diloco_overlap: overlap each outer round with the next epoch's inner steps (``diloco``
            mode; :mod:`peer.swarm.diloco`).
        min_round_interval_s: the least time from the end of one of this peer's rounds to the
            start of its next round with others, in seconds; a target the swarm reaches sooner
            is gathered on until then (the epoch holds more samples). A round sends each
            partner about 4 requests, so 0.05 s (20 rounds a second at most) keeps an honest
            peer under half of the share each peer's server grants another (200 requests a
            second by default): 80 rounds a second, as a one-batch target on a small model
            made, took all of it, and rounds failed on refusals.
    """

    mode: Mode = "grad"
    target_batch_size: int
    averaging_timeout_s: float = 30.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    accumulate_in_grad: bool = True
    delay_update: bool = False
    diloco_overlap: bool = False
    min_round_interval_s: float = 0.05

    def __post_init__(self) -> None:
        if self.delay_update and self.mode != "grad":
            raise ConfigError("delay_update needs mode grad")
        if self.diloco_overlap and self.mode != "diloco":
            raise ConfigError("diloco_overlap needs mode diloco")
        if self.mode not in ("grad", "params", "diloco"):
            raise ConfigError(f"mode must be grad, params or diloco, got {self.mode!r}")
        if self.target_batch_size < 1:
            raise ConfigError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        for name in ("averaging_timeout_s", "outer_lr", "outer_momentum", "min_round_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


def make_contribution(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: CollaborativeConfig
) -> Contribution:
    """The averaged buffers and the mode's arithmetic for ``config``."""
    return Contribution(
        model,
        optimizer,
        mode=config.mode,
        accumulate_in_grad=config.accumulate_in_grad,
        separate_accumulators=config.delay_update,
        outer_lr=config.outer_lr,
        outer_momentum=config.outer_momentum,
        diloco_overlap=config.diloco_overlap,
    )
