"""Phases of a user's own training loop, for the profiler of :class:`peer.Optimizer`.

A loop looks like ``for batch in loader: loss = f(model, batch); loss.backward(); opt.step()``.
Nothing in it tells the profiler where forward ends, so the boundaries are the calls it can see:

* ``peer.profile(loader)`` hands out the batches; the wait for the next one is ``data``;
* the first parameter gradient of a backward pass starts ``backward`` (a gradient hook on every
  parameter; the loss's own backward before it counts as ``forward``);
* ``opt.step()`` is ``optimizer``, with the round inside it charged to ``matchmaking``,
  ``allreduce`` and ``state_sync`` by the components that run it;
* the time from a batch's arrival to the first gradient is ``forward``. After ``opt.step()``
  the time until the next batch is requested is ``other`` (logging, evaluation), or ``forward``
  when the loop does not use ``peer.profile`` (then data loading counts as ``forward`` too).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

import torch

from peer.profiling.phases import PhaseClock


class _Profiled(Protocol):
    """What ``profile`` needs of the optimizer it charges (:class:`peer.Optimizer`)."""

    @property
    def loop_phases(self) -> LoopPhases: ...


T = TypeVar("T")
_active: weakref.ref[_Profiled] | None = None
_lock = threading.Lock()


def set_active(optimizer: _Profiled | None) -> None:
    """The optimizer whose profiler ``profile`` charges (the newest one alive)."""
    global _active
    with _lock:
        _active = None if optimizer is None else weakref.ref(optimizer)


def active_loop_phases() -> LoopPhases | None:
    """The phases of the newest optimizer alive, or None."""
    optimizer = _active() if _active is not None else None
    return None if optimizer is None else optimizer.loop_phases


class LoopPhases:
    """The base phase of the training thread: data, forward, backward, optimizer or other.

    Args:
        clock: the profiler's clock.
        params: the parameters whose first gradient marks the start of ``backward``.
    """

    def __init__(self, clock: PhaseClock, params: list[torch.Tensor]):
        self._sequence = clock.sequence("forward")
        self._sequence.__enter__()
        self._current = "forward"
        self.profiled = False  # whether the loop hands out batches through peer.profile
        self._closed = False
        self._handles = [p.register_hook(self._on_grad) for p in params if p.requires_grad]

    def switch(self, name: str) -> None:
        """Charge the time from now on to ``name`` (a no-op when it already is)."""
        if self._closed or name == self._current:
            return
        self._current = name
        self._sequence.switch(name)

    def _on_grad(self, grad: torch.Tensor) -> None:
        if self._current == "forward":
            self.switch("backward")

    def after_step(self) -> None:
        """``opt.step()`` returned: the loop's own code runs until the next batch."""
        self.switch("other" if self.profiled else "forward")

    def close(self) -> None:
        """Remove the hooks and end the phases; safe to call twice."""
        if self._closed:
            return
        for handle in self._handles:
            handle.remove()
        self._sequence.__exit__(None, None, None)
        self._closed = True


def profile(iterable: Iterable[T]) -> Iterator[T]:
    """Hand out ``iterable``'s items, charging the wait for each to the ``data`` phase of the
    current :class:`peer.Optimizer`'s profiler (the newest one not shut down).

    Wrap the DataLoader (or any iterable) of the training loop::

        for inputs, targets in peer.profile(loader):
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()

    Without an optimizer alive it only passes the items through.

    Args:
        iterable: the batches.

    Yields:
        The items of ``iterable``, unchanged.
    """
    iterator = iter(iterable)
    while True:
        phases = active_loop_phases()
        if phases is not None:
            phases.profiled = True
            phases.switch("data")
        try:
            item = next(iterator)
        except StopIteration:
            if phases is not None:
                phases.switch("other")
            return
        if phases is not None:
            phases.switch("forward")
        yield item
