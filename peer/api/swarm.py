"""What a library peer's swarm side reads of the user's loop: the model of its parameters and
the loop's counts."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class LoopCounts:
    """What :class:`peer.swarm.catch_up.StateCatchUp` reads of a trainer: the model whose state
    is served and loaded, and the counts that go into snapshots."""

    model: nn.Module
    step: int = 0
    total_samples: int = 0


def params_module(params: list[nn.Parameter]) -> nn.Module:
    """A module holding exactly ``params`` (the same tensors), for state sync and snapshots:
    hivemind's API takes parameters, not a model."""
    module = nn.Module()
    module.params = nn.ParameterList(params)
    return module
