"""DiLoCo's outer step: blocking, or overlapped with the next inner steps (one round late).

Notation, per peer: ``x`` the model the inner optimizer steps; ``g`` the swarm's replica (equal
bit for bit on every peer whose rounds were full: each applies the same averages); ``a`` the
anchor the inner progress is measured from; ``Δ`` the pseudo-gradient; ``Δ̄`` the round's
sample-weighted average of the group's ``Δ``. The outer optimizer is torch's SGD with Nesterov
momentum (``η`` = ``outer_lr``, ``μ`` = ``outer_momentum``, momentum ``m``)::

    OuterOpt(g, Δ̄):  m <- μ m + Δ̄;  g <- g - η (Δ̄ + μ m)

Blocking (DiLoCo: Douillard et al. 2023, arXiv:2311.08105): every inner phase starts at
``x = a = g``. At the phase's end::

    Δ = a - x;  (round: Δ̄);  g <- OuterOpt(g, Δ̄);  x <- g

``g`` and ``a`` are then one set of tensors (no copy beyond the anchor).

Overlapped (``overlap``): at the end of phase ``t`` the round of ``Δ_t`` starts in the
background and phase ``t + 1`` goes on from the peer's own iterate::

    boundary t:          Δ_t = a - x;  a <- x            (round t starts; x goes on)
    round t ends (during phase t + 1, or at its end at the latest):
                         g <- OuterOpt(g, Δ̄_t);  x <- g + (x - a);  a <- g

The inner progress ``δ = x - a`` made while the round ran is kept, moved from the peer's own
iterate onto the new replica; the next ``Δ`` (``a - x`` at the next boundary) still measures
exactly one phase's progress. Until the round ends the peer computes at ``g_t - Δ_t + δ``: its
own pseudo-gradient stands in for the swarm's average, the idea of the "eager updates" of Kale,
Douillard and Donchev 2025 (arXiv:2502.12996; their eager step mixes the local outer gradient,
weighted 1/M, with the delayed ones of the others into the outer step itself, so their replicas
differ per worker; here the stand-in touches only the iterate, and ``g`` only ever takes full
averages, so replicas stay equal). Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512)
and torchft's implementation of it overlap a round with only ``τ < H`` inner steps and then mix
``x <- g + α (x - g)`` (torchft's ``fragment_update_alpha``; α = 0 drops what was computed
meanwhile): with the round spread over a whole phase (``τ = H``), as here, dropping it would
throw away a phase of compute, so the progress is kept whole (the α = 1 end, measured from the
anchor). Compute never waits for the round unless it outlasts a whole phase (then the next
boundary waits for it, charged to ``allreduce``); the outer step lands one round late.

In floating point ``x <- g - (a - x)``: when no inner step ran since the boundary (the peer
stopped there), ``a - x`` is exactly 0 and ``x`` becomes ``g`` bit for bit, so peers that stop at
the same epoch end with equal replicas. The state a peer serves and checkpoints is ``g``
(:meth:`OuterStep.replica_in_model`), never its own iterate; overlapped, the state it serves
for epoch ``t + 1`` is ``g`` once round ``t`` has landed (:class:`peer.swarm.epoch.Epoch`), so
that a download holds every outer step its donor's replica holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class OuterStep:
    """The anchor, the replica and the outer optimizer of one DiLoCo peer.

    Args:
        params: the model's trainable parameters (the inner optimizer's).
        outer_lr: the outer optimizer's learning rate ``η``.
        outer_momentum: its Nesterov momentum ``μ``.
        overlap: apply each round's average one round late, keeping the inner progress made
            meanwhile (see the module docstring); costs one more copy of the parameters.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        outer_lr: float,
        outer_momentum: float,
        overlap: bool = False,
    ):
        self.params = list(params)
        self.overlap = overlap
        self.anchor = [p.detach().clone() for p in self.params]
        # blocking: the anchor is the replica (every phase starts at g)
        self.replica = [a.clone() for a in self.anchor] if overlap else self.anchor
        self._outer = torch.optim.SGD(
            self.replica, lr=outer_lr, momentum=outer_momentum, nesterov=True
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The outer optimizer (its momentum is served and loaded with the replica)."""
        return self._outer

    @torch.no_grad()
    def prepare(self, buffers: Sequence[torch.Tensor]) -> None:
        """End of a phase: its pseudo-gradient ``a - x`` into ``buffers``; overlapped, the next
        phase's progress is measured from here (``a <- x``)."""
        for buffer, anchor, param in zip(buffers, self.anchor, self.params, strict=True):
            torch.sub(anchor, param, out=buffer)
            if self.overlap:
                anchor.copy_(param)

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor]) -> None:
        """The round's average (or this peer's own pseudo-gradient, after a round that failed)
        in ``averaged``: one outer step on ``g``, then ``x`` moves onto it."""
        for replica, average in zip(self.replica, averaged, strict=True):
            replica.grad = average
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        for param, anchor, replica in zip(self.params, self.anchor, self.replica, strict=True):
            if self.overlap:
                anchor.sub_(param)  # a - x: minus the progress made while the round ran
                torch.sub(replica, anchor, out=param)  # x <- g - (a - x), exact when a == x
                anchor.copy_(replica)
            else:
                param.copy_(replica)

    @torch.no_grad()
    def restart(self) -> None:
        """The model was replaced from outside (a download, a loaded state): it is the replica,
        and the next phase starts from it."""
        for anchor, replica, param in zip(self.anchor, self.replica, self.params, strict=True):
            anchor.copy_(param)
            if self.overlap:
                replica.copy_(param)

    @contextmanager
    def replica_in_model(self) -> Iterator[None]:
        """Within: the model holds ``g``, so what reads it at an epoch change (the state server's
        snapshot and digest, checkpoints) sees the replica every peer agrees on, not this peer's
        iterate; the iterate comes back after. Blocking, the model is ``g`` there already."""
        if not self.overlap:
            yield
            return
        with torch.no_grad():
            iterate = [p.detach().clone() for p in self.params]
            for param, replica in zip(self.params, self.replica, strict=True):
                param.copy_(replica)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in zip(self.params, iterate, strict=True):
                    param.copy_(saved)
