"""The peer's swarm epoch: the one place it is kept.

The collaborative optimizer moves it (after a round, or after a state download put the peer at
the swarm's epoch); everything else reads :attr:`Epoch.value` or subscribes to its boundaries
(the profiler's epoch marks, the state server, the round record, checkpoints, the ``max_epochs``
stop). Both ways of moving go through :meth:`Epoch.advance_to`, so no reader can miss a
catch-up.

The state of an epoch (what the state server serves and digests) is the replica with every
round before the epoch applied. With rounds in the background (``delay_update``,
``diloco_overlap``) the round of epoch ``e - 1`` is still in flight when ``e`` begins: its
state is whole only once that round lands. State listeners (:meth:`Epoch.subscribe_state`) hear
of an epoch then (:meth:`Epoch.settle`), so every peer serves, digests and compares the state of
an epoch at the same point of its pipeline, and a download of epoch ``e`` holds every update a
peer that trained through ``e`` holds (a state taken at the boundary would trail by the round
in flight: a re-synced replica or a newcomer would land one step behind, for good).
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
        self._state_listeners: list[Listener] = []
        self._state_pending = False  # the round before this epoch is still in flight

    @property
    def value(self) -> int:
        return self._value

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(epoch)`` in the training thread after every move."""
        self._listeners.append(listener)

    def subscribe_state(self, listener: Listener) -> None:
        """Call ``listener(epoch)`` in the training thread once the state of each epoch is
        whole: at the move itself, or when the round in flight lands (:meth:`settle`)."""
        self._state_listeners.append(listener)

    @property
    def state_pending(self) -> bool:
        """Whether the round before this epoch is still in flight (its state not whole yet)."""
        return self._state_pending

    def advance_to(self, epoch: int, *, state_pending: bool = False) -> bool:
        """Move to ``epoch`` and tell the listeners; False (nothing happens) unless it is ahead.
        ``state_pending``: the round of the epoch before runs on in the background; the state
        listeners hear of ``epoch`` when it lands (:meth:`settle`).

        An epoch never goes back: a peer that fell behind downloads a later state instead.
        """
        if epoch <= self._value:
            return False
        self._move(epoch, state_pending=state_pending)
        return True

    def settle(self) -> bool:
        """The round in flight landed: the state of this epoch is whole; tell the state
        listeners (once per epoch). False when nothing was pending."""
        if not self._state_pending:
            return False
        self._state_pending = False
        for listener in self._state_listeners:
            listener(self._value)
        return True

    def jump_to(self, epoch: int) -> bool:
        """Move to ``epoch`` either way (a state the user loaded, which may be older) and tell
        the listeners; False when it is the epoch already."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch == self._value:
            return False
        self._move(epoch, state_pending=False)
        return True

    def _move(self, epoch: int, *, state_pending: bool) -> None:
        self._value = epoch
        self._state_pending = state_pending
        for listener in self._listeners:
            listener(epoch)
        if not state_pending:
            for listener in self._state_listeners:
                listener(epoch)

    def __int__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"Epoch({self._value})"
