"""The phase clock: every second of a peer's life attributed to exactly one phase.

``with clock.phase("forward"): ...`` charges the time spent inside to ``forward``. At any moment
exactly one phase is current, so the phases always sum to the wall time since the clock started:
time outside any phase is ``other``; in nested phases the inner one takes the time and the outer
one resumes when it ends. The clock is process-wide, not per thread: a phase entered by any
thread (e.g. the main thread blocking on the network facade marks ``allreduce``) becomes current
until it ends, and a phase ending out of order (threads interleaving) is removed from wherever
it is in the stack.

Timing GPU work. CUDA kernels run asynchronously: by default (``synchronize=None``) a phase is
charged for the time the CPU spends in it, so ``forward`` and ``backward`` measure kernel
launches, and the GPU's real compute time lands in whichever later phase first waits for the GPU
(an ``.item()``, the optimizer's overflow check, a device-to-host copy in ``allreduce``, ...).
The sum stays exact; the split between compute phases and the one that waits can be off. The
opt-in synchronize mode (``PhaseClock(synchronize=device_synchronize(device))``) waits for the
GPU at every phase boundary, so each phase is charged its own GPU work; the cost is the lost
overlap of CPU and GPU (the CPU can no longer queue the next kernels while the GPU runs), which
slows small-model steps by a few percent or more, and a boundary crossed by another thread also
waits for the main thread's queued kernels, charging them to that thread's phase.

Cost: one lock acquisition and one ``time.perf_counter`` call per boundary, about a microsecond.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from types import TracebackType

from peer.records.profile import PROFILE_PHASES

# Every second of a peer goes to one of these (the metrics stream's and profile record's phases).
PHASES: tuple[str, ...] = PROFILE_PHASES
_OTHER = PHASES.index("other")
# Called with (phase, start_s, end_s) for every closed stretch of time, in order.
SegmentListener = Callable[[str, float, float], None]


@dataclasses.dataclass(frozen=True)
class PhaseSnapshot:
    """Seconds per phase over a stretch of wall time.

    Attributes:
        seconds: every phase of :data:`PHASES` -> seconds charged to it.
        wall_s: the stretch's wall time; equals ``sum(seconds.values())`` up to rounding.
    """

    seconds: dict[str, float]
    wall_s: float

    def fractions(self) -> dict[str, float]:
        """Share of the wall time per phase (all zeros for an empty stretch)."""
        if self.wall_s <= 0:
            return dict.fromkeys(self.seconds, 0.0)
        return {name: s / self.wall_s for name, s in self.seconds.items()}


class _Scope:
    """The context manager of one phase; stateless, so one instance serves every use."""

    __slots__ = ("_clock", "_index")

    def __init__(self, clock: PhaseClock, index: int):
        self._clock = clock
        self._index = index

    def __enter__(self) -> None:
        self._clock._enter(self._index)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._clock._exit(self._index)


class PhaseSequence:
    """Consecutive phases with a single boundary between each (see :meth:`PhaseClock.sequence`).

    ``switch`` ends the current phase and starts the next at one instant: one lock and one
    reading of the time instead of an exit and an enter with a sliver of ``other`` between.
    """

    __slots__ = ("_clock", "_index")

    def __init__(self, clock: PhaseClock, index: int):
        self._clock = clock
        self._index = index

    def switch(self, name: str) -> None:
        """End the current phase of this sequence and start ``name``.

        Raises:
            ValueError: ``name`` is not one of :data:`PHASES`.
        """
        index = self._clock._index_of(name)
        self._clock._switch(self._index, index)
        self._index = index

    def __enter__(self) -> PhaseSequence:
        self._clock._enter(self._index)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._clock._exit(self._index)


class PhaseClock:
    """Attributes monotonic time to phases; see the module docstring for the rules.

    Args:
        now: the time source in seconds (``time.perf_counter``; tests inject a fake clock).
        synchronize: called before reading the time at every boundary, e.g.
            ``torch.cuda.synchronize`` (see :func:`peer.train.device.device_synchronize`).
        listener: called with ``(phase, start_s, end_s)`` for each closed stretch, under the
            clock's lock, in time order (for traces); must be quick.
    """

    def __init__(
        self,
        *,
        now: Callable[[], float] = time.perf_counter,
        synchronize: Callable[[], None] | None = None,
        listener: SegmentListener | None = None,
    ):
        self._now = now
        self._synchronize = synchronize
        self._listener = listener
        self._lock = threading.Lock()
        self._indices = {name: i for i, name in enumerate(PHASES)}
        self._scopes = {name: _Scope(self, i) for i, name in enumerate(PHASES)}
        self._stack = [_OTHER]
        self._totals = [0.0] * len(PHASES)
        self._start = self._last = now()
        self._interval_totals = list(self._totals)
        self._interval_start = self._start

    def phase(self, name: str) -> _Scope:
        """A context manager charging the time inside it to ``name``.

        Raises:
            ValueError: ``name`` is not one of :data:`PHASES`.
        """
        try:
            return self._scopes[name]
        except KeyError:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}") from None

    def sequence(self, first: str) -> PhaseSequence:
        """A context manager for phases that follow each other, starting with ``first``.

        ``with clock.sequence("h2d") as phase: ...; phase.switch("forward"); ...`` charges the
        same time as consecutive :meth:`phase` blocks with half the boundaries (the training
        step's hot path). Phases nested inside work as with :meth:`phase`.

        Raises:
            ValueError: ``first`` is not one of :data:`PHASES`.
        """
        return PhaseSequence(self, self._index_of(first))

    def _index_of(self, name: str) -> int:
        try:
            return self._indices[name]
        except KeyError:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}") from None

    @property
    def current(self) -> str:
        """The phase time is being charged to now."""
        return PHASES[self._stack[-1]]

    def _advance(self) -> float:
        # Caller holds the lock: charge the time since the last boundary to the current phase.
        now = self._now()
        index = self._stack[-1]
        self._totals[index] += now - self._last
        if self._listener is not None and now > self._last:
            self._listener(PHASES[index], self._last, now)
        self._last = now
        return now

    def _enter(self, index: int) -> None:
        if self._synchronize is not None:
            self._synchronize()
        with self._lock:
            self._advance()
            self._stack.append(index)

    def _exit(self, index: int) -> None:
        if self._synchronize is not None:
            self._synchronize()
        with self._lock:
            self._advance()
            stack = self._stack
            if stack[-1] == index:
                stack.pop()
                return
            # Another thread's phase is on top: remove ours from below it (never the base).
            for position in range(len(stack) - 1, 0, -1):
                if stack[position] == index:
                    del stack[position]
                    return

    def _switch(self, old: int, new: int) -> None:
        if self._synchronize is not None:
            self._synchronize()
        with self._lock:
            self._advance()
            stack = self._stack
            if stack[-1] == old:
                stack[-1] = new
                return
            # Another thread's phase is on top: replace ours below it, or start ``new`` anew.
            for position in range(len(stack) - 1, 0, -1):
                if stack[position] == old:
                    stack[position] = new
                    return
            stack.append(new)

    def transfer(self, seconds: float, source: str, target: str) -> None:
        """Move ``seconds`` already charged to ``source`` over to ``target``.

        For a blocking call whose callee reports afterwards how its time split (the averager's
        matchmaking and all-reduce seconds): the caller marks the whole call with one phase and
        moves the callee's share. Totals and intervals move; trace segments already emitted do
        not. At most what ``source`` holds in the current interval moves.
        """
        src, dst = PHASES.index(source), PHASES.index(target)
        with self._lock:
            available = self._totals[src] - self._interval_totals[src]
            moved = min(max(seconds, 0.0), max(available, 0.0))
            self._totals[src] -= moved
            self._totals[dst] += moved

    def _read(self) -> float:
        # Caller holds the lock: advance to now, then let a subclass settle what it attributes
        # only when the clock is read (``cpu_wait``, see ``profiled_clock.ProfiledClock``).
        now = self._advance()
        self._settle()
        return now

    def _settle(self) -> None:
        pass

    def snapshot(self) -> PhaseSnapshot:
        """Seconds per phase since the clock started, the open phase included up to now."""
        with self._lock:
            now = self._read()
            return self._make_snapshot(self._totals, now - self._start)

    def interval(self) -> PhaseSnapshot:
        """Seconds per phase since the last :meth:`reset_interval` (or the start)."""
        with self._lock:
            now = self._read()
            return self._interval_since(now)

    def reset_interval(self) -> PhaseSnapshot:
        """Return the current interval's numbers and start a new interval now."""
        with self._lock:
            now = self._read()
            snapshot = self._interval_since(now)
            self._interval_totals = list(self._totals)
            self._interval_start = now
            return snapshot

    def _interval_since(self, now: float) -> PhaseSnapshot:
        totals = [t - base for t, base in zip(self._totals, self._interval_totals, strict=True)]
        return self._make_snapshot(totals, now - self._interval_start)

    @staticmethod
    def _make_snapshot(totals: list[float], wall_s: float) -> PhaseSnapshot:
        return PhaseSnapshot(dict(zip(PHASES, totals, strict=True)), wall_s)


class NullClock(PhaseClock):
    """Profiling off: boundaries read no time and take no lock; every second stays in ``other``.

    The baseline of ``peer bench profiler``: the same code path with the instrumentation off.
    """

    def _enter(self, index: int) -> None:
        pass

    def _exit(self, index: int) -> None:
        pass

    def _switch(self, old: int, new: int) -> None:
        pass
