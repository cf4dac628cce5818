"""What a library peer's swarm side reads of the user's loop: the model of its parameters (the
user's, or one made of the parameters) and the loop's counts."""

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


def state_module(model: object, params: list[nn.Parameter]) -> nn.Module:
    """The module whose state a peer serves and loads: ``model`` when given (its trainable
    parameters must be exactly ``params``), else :func:`params_module` of ``params``.

    Raises:
        ValueError: naming ``model``.
    """
    if model is None:
        return params_module(params)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: a torch.nn.Module, got {type(model).__name__}")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    given = {id(p) for p in params}
    if trainable != given:
        raise ValueError(
            f"model: its trainable parameters must be the optimizer's ({len(given - trainable)} "
            f"of the optimizer's are not in it, {len(trainable - given)} of its are not in "
            "the optimizer)"
        )
    return model
