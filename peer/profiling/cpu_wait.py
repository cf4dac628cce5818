"""Waiting for a CPU: the time a peer was runnable but not running, as the ``cpu_wait`` phase.

A peer on an oversubscribed machine (24 peers on 2 cores) is slow because the scheduler runs
something else, not because the swarm is slow; without this phase that time lands in whatever
phase the peer was in: in ``forward`` while it computes, in ``allreduce`` while the training
thread waits for the event-loop thread that does the round. Linux counts, per thread, the
nanoseconds it spent on a run queue without a CPU (``/proc/<pid>/task/<tid>/schedstat``, second
field). :class:`CpuWaitAccount` reads that counter for two threads and moves the time into
``cpu_wait`` whenever the clock is read (marks, metrics lines, scrapes; never per step):

* the training thread's delay since the last reading, taken from the phases the training
  thread runs in (everything but communication, ``idle`` and ``cpu_wait`` itself), in
  proportion to their time since that reading;
* the event-loop thread's delay while the training thread was in a communication phase
  (read at the outermost communication phase's start and end, and at readings in between),
  taken from the communication phases in the same way.

What moves is bounded by what those phases hold since the last reading, so phases never go
negative and the sum stays the wall time. Where the counter is missing (not Linux, a kernel
without schedstats) nothing moves and ``cpu_wait`` stays 0. A reading costs one ``pread`` of a
file kept open (a few microseconds).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from peer.records.profile import PROFILE_PHASES

CPU_WAIT = "cpu_wait"
# The phases during which the event-loop thread works for the training thread.
COMMUNICATION_PHASES: tuple[str, ...] = ("matchmaking", "allreduce", "state_sync")
# The phases during which the training thread sleeps: its own delay is not taken from them.
_TRAINING_SLEEPS = frozenset((*COMMUNICATION_PHASES, "idle", CPU_WAIT))
_CPU_WAIT_INDEX = PROFILE_PHASES.index(CPU_WAIT)
_COMMUNICATION = tuple(PROFILE_PHASES.index(p) for p in COMMUNICATION_PHASES)
_TRAINING_RUNS = tuple(i for i, p in enumerate(PROFILE_PHASES) if p not in _TRAINING_SLEEPS)
_SCHEDSTAT_BYTES = 128


class RunQueueProbe:
    """The run-queue delay of one thread of this process, in seconds since it started.

    Args:
        native_id: the thread's id (:func:`threading.get_native_id`).
    """

    def __init__(self, native_id: int):
        self.native_id = native_id
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        if self.wait_s() is None:
            self.close()

    @property
    def available(self) -> bool:
        return self._fd is not None

    def wait_s(self) -> float | None:
        """Seconds the thread has spent runnable but not running, or None (no counter)."""
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, _SCHEDSTAT_BYTES, 0).split()
            return int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):
            self.close()
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _take(
    totals: list[float],
    since: list[float],
    taken: list[float],
    indices: Sequence[int],
    seconds: float,
) -> None:
    """Move up to ``seconds`` from ``indices`` to ``cpu_wait``, in proportion to each one's
    time since the last reading (``since``, updated); ``taken`` adds up what left each."""
    available = sum(max(since[i], 0.0) for i in indices)
    moved = min(seconds, available)
    if moved <= 0:
        return
    for i in indices:
        share = max(since[i], 0.0) / available * moved
        totals[i] -= share
        since[i] -= share
        taken[i] += share
    totals[_CPU_WAIT_INDEX] += moved


class CpuWaitAccount:
    """Moves the watched threads' run-queue delay into ``cpu_wait`` (see the module docstring).

    Not thread-safe: the clock calls every method under its lock.
    """

    def __init__(self, num_phases: int = len(PROFILE_PHASES)):
        self._training: RunQueueProbe | None = None
        self._loop: RunQueueProbe | None = None
        self._training_last_s = 0.0
        self._depth = 0  # communication phases open
        self._loop_last_s = 0.0  # the loop thread's delay when last read in communication
        self._loop_pending_s = 0.0  # its delay in communication not moved yet
        self._base = [0.0] * num_phases  # the clock's totals at the last reading
        self._taken = [0.0] * num_phases  # seconds moved out of each phase so far

    def watch(self, *, training: int | None = None, loop: int | None = None) -> None:
        """Watch these threads (native ids) from now on; None leaves a role as it is."""
        if training is not None:
            self._replace("_training", training)
            self._training_last_s = self._training.wait_s() or 0.0
        if loop is not None:
            self._replace("_loop", loop)
            self._loop_last_s = self._loop.wait_s() or 0.0

    def _replace(self, role: str, native_id: int) -> None:
        old = getattr(self, role)
        if old is not None:
            old.close()
        setattr(self, role, RunQueueProbe(native_id))

    @property
    def watching(self) -> bool:
        """Whether any watched thread has a counter to read."""
        return any(p is not None and p.available for p in (self._training, self._loop))

    def communication_started(self) -> None:
        self._depth += 1
        if self._depth == 1 and self._loop is not None:
            self._loop_last_s = self._loop.wait_s() or self._loop_last_s

    def communication_ended(self) -> None:
        if self._depth == 0:
            return
        self._read_loop()
        self._depth -= 1

    def _read_loop(self) -> None:
        if self._depth > 0 and self._loop is not None:
            now_s = self._loop.wait_s()
            if now_s is not None:
                self._loop_pending_s += max(now_s - self._loop_last_s, 0.0)
                self._loop_last_s = now_s

    def settle(self, totals: list[float]) -> None:
        """Move the delay since the last call from ``totals`` (the clock's, in place)."""
        since = [t - b for t, b in zip(totals, self._base, strict=True)]
        if self._training is not None:
            now_s = self._training.wait_s()
            if now_s is not None:
                waited_s = now_s - self._training_last_s
                _take(totals, since, self._taken, _TRAINING_RUNS, waited_s)
                self._training_last_s = now_s
        self._read_loop()
        if self._loop_pending_s > 0:
            _take(totals, since, self._taken, _COMMUNICATION, self._loop_pending_s)
            self._loop_pending_s = 0.0  # what did not fit was not in this stretch's phases
        self._base = list(totals)

    def taken(self) -> dict[str, float]:
        """Seconds moved into ``cpu_wait`` so far, by the phase they were charged to first."""
        return dict(zip(PROFILE_PHASES, self._taken, strict=True))

    def close(self) -> None:
        for probe in (self._training, self._loop):
            if probe is not None:
                probe.close()
