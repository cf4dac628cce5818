"""The profiler's phase clock: a :class:`~peer.profiling.phases.PhaseClock` that reports moves
between phases to the trace and takes the watched threads' waits for a CPU out of the phases they
were charged to (into ``cpu_wait``, :mod:`peer.profiling.cpu_wait`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from peer.profiling.cpu_wait import COMMUNICATION_PHASES, CpuWaitAccount
from peer.profiling.phases import PhaseClock, _Scope


class _CommunicationScope(_Scope):
    """A communication phase: the event-loop thread's CPU wait inside it is ``cpu_wait``."""

    __slots__ = ()

    def __enter__(self) -> None:
        self._clock._enter(self._index)
        self._clock._communication(started=True)

    def __exit__(self, *exc_info: object) -> None:
        self._clock._communication(started=False)
        self._clock._exit(self._index)


class ProfiledClock(PhaseClock):
    """A :class:`PhaseClock` that also tells the trace when time moves between phases, and
    moves the watched threads' waits for a CPU into ``cpu_wait`` whenever it is read
    (:mod:`peer.profiling.cpu_wait`). With the real time source it watches the thread that
    made it as the training thread; :meth:`watch_threads` changes that and adds the event-loop
    thread."""

    def __init__(self, *, on_transfer: Callable[[float, str, str], None] | None = None, **kwargs):
        super().__init__(**kwargs)
        self._on_transfer = on_transfer
        self.start_s = self._start
        self._cpu_wait = CpuWaitAccount()
        if self._now is time.perf_counter:  # run-queue delay is real time: not for fake clocks
            self._cpu_wait.watch(training=threading.get_native_id())
        for name in COMMUNICATION_PHASES:
            self._scopes[name] = _CommunicationScope(self, self._indices[name])

    def watch_threads(self, *, training: int | None = None, loop: int | None = None) -> None:
        """Count these threads' (native ids) waits for a CPU: ``training`` always, ``loop``
        during communication phases; None leaves a role as it is."""
        with self._lock:
            self._cpu_wait.watch(training=training, loop=loop)

    def cpu_wait_taken(self) -> dict[str, float]:
        """Seconds moved into ``cpu_wait`` so far, by the phase they were charged to first."""
        with self._lock:
            return self._cpu_wait.taken()

    def _communication(self, *, started: bool) -> None:
        with self._lock:
            if started:
                self._cpu_wait.communication_started()
            else:
                self._cpu_wait.communication_ended()

    def _settle(self) -> None:
        self._cpu_wait.settle(self._totals)

    def transfer(self, seconds: float, source: str, target: str) -> None:
        super().transfer(seconds, source, target)
        if self._on_transfer is not None:
            self._on_transfer(seconds, source, target)

    def close(self) -> None:
        """Stop reading the threads' counters."""
        with self._lock:
            self._cpu_wait.close()
