"""The peer's swarm epoch: the one place it is kept.

The collaborative optimizer moves it (after a round, or after a state download put the peer at
the swarm's epoch); everything else reads :attr:`Epoch.value` or subscribes to its boundaries
(the profiler's epoch marks, the state server, the round record, checkpoints, the ``max_epochs``
stop). Both ways of moving go through :meth:`Epoch.advance_to`, so no reader can miss a
catch-up.
"""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[int], None]


class Epoch:
    """A monotonic epoch counter with listeners of its boundaries.

    Args:
        value: the epoch to start at (after a checkpoint or a state download).
    """

    def __init__(self, value: int = 0):
        if value < 0:
            raise ValueError(f"epoch must be >= 0, got {value}")
        self._value = value
        self._listeners: list[Listener] = []

    @property
    def value(self) -> int:
        return self._value

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(epoch)`` in the training thread after every move."""
        self._listeners.append(listener)

    def advance_to(self, epoch: int) -> bool:
        """Move to ``epoch`` and tell the listeners; False (nothing happens) unless it is ahead.

        An epoch never goes back: a peer that fell behind downloads a later state instead.
        """
        if epoch <= self._value:
            return False
        self._value = epoch
        for listener in self._listeners:
            listener(epoch)
        return True

    def jump_to(self, epoch: int) -> bool:
        """Move to ``epoch`` either way (a state the user loaded, which may be older) and tell
        the listeners; False when it is the epoch already."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch == self._value:
            return False
        self._value = epoch
        for listener in self._listeners:
            listener(epoch)
        return True

    def __int__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"Epoch({self._value})"
