"""A Chrome trace / Perfetto JSON of a peer's phases, rounds and epochs (``--trace FILE``).

The file is the trace-event *array* format: ``[`` followed by one event per line. Every event
is written as it happens, so a peer that is killed leaves a file that Perfetto and
``chrome://tracing`` still open (both accept an array without its closing bracket); a clean
close writes the ``]`` and the file is strict JSON.

Tracks (thread ids of one process):

* ``phases``: one complete event (``"ph": "X"``) per stretch of a phase of the
  :class:`peer.profiling.phases.PhaseClock`; adjacent stretches of the same phase are merged (a
  snapshot of
  the clock splits the current stretch, which would otherwise show as two slices). ``other``
  stretches shorter than ``min_other_s`` (the few microseconds between two phases of a step) are
  left out: they would double the file and show as gaps anyway.
* ``rounds``: one slice per averaging round: a contiguous stretch of ``matchmaking`` and
  ``allreduce``. The blocking averaging call is charged to ``matchmaking`` while it runs; when the
  averager reports its all-reduce seconds (:meth:`TraceWriter.transfer`), the tail of that
  stretch becomes an ``allreduce`` slice (the averager forms its group first, then all-reduces).
* ``epochs``: one slice per swarm epoch, with the epoch's phase fractions as arguments.
* counters (``"ph": "C"``): samples/s and network rates at every rolling summary.

Size: phase slices stop once the file reaches ``max_bytes``, with an instant event saying so;
epochs, rounds and counters (a few per epoch) go on until twice that size, so a long run keeps
its per-epoch breakdown. Timestamps are microseconds since the clock's first stretch began.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

PHASES_TID, ROUNDS_TID, EPOCHS_TID = 1, 2, 3
_TRACK_NAMES = {PHASES_TID: "phases", ROUNDS_TID: "rounds", EPOCHS_TID: "epochs"}
_COMM = frozenset({"matchmaking", "allreduce"})
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_MIN_OTHER_S = 200e-6
# Events are collected and written in batches of about this many bytes, each in one write call,
# so the file ends at an event boundary whenever the process dies.
WRITE_BATCH_BYTES = 1 << 16
# Phase stretches are queued and turned into events this many at a time (see ``segment``).
PENDING_SEGMENTS = 256


class TraceWriter:
    """Writes one process's trace; every method is thread-safe and ``close`` is safe twice.

    Args:
        path: the file (replaced).
        process_name: what Perfetto names the process (e.g. ``peer 1a2b3c4d``).
        max_bytes: phase slices stop at this file size; everything stops at twice it.
        min_other_s: shorter ``other`` stretches are not written.
        pid: the process id written in events.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        process_name: str = "peer",
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_other_s: float = DEFAULT_MIN_OTHER_S,
        pid: int | None = None,
    ):
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be >= 1024, got {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.min_other_s = min_other_s
        self.num_events = 0
        self.num_bytes = 0
        self.phases_stopped = False
        self._pid = os.getpid() if pid is None else pid
        self._lock = threading.Lock()
        self._file: BinaryIO | None = self.path.open("wb", buffering=0)
        self._pending: collections.deque[tuple[str, float, float]] = collections.deque()
        self._batch: list[str] = []
        self._batch_bytes = 0
        self._origin_s: float | None = None
        self._held: list[Any] | None = None  # [phase, start_s, end_s]: the open-ended stretch
        self._round: list[Any] | None = None  # [start_s, end_s, {phase: seconds}]
        self._first = True
        self._write_raw("[\n")
        self._meta("process_name", 0, {"name": process_name})
        for tid, name in _TRACK_NAMES.items():
            self._meta("thread_name", tid, {"name": name})
            self._meta("thread_sort_index", tid, {"sort_index": tid})

    # ---- feeding -------------------------------------------------------------------------------

    def segment(self, phase: str, start_s: float, end_s: float) -> None:
        """One closed stretch of ``phase`` (the :class:`~peer.profiling.phases.PhaseClock`
        listener).

        Only queued here: this runs on the training thread at every phase boundary, right after
        the step's kernels have evicted this code's caches, where formatting one event costs
        several microseconds; a batch of them formatted together costs a fraction of that.
        """
        pending = self._pending
        pending.append((phase, start_s, end_s))
        if len(pending) >= PENDING_SEGMENTS:
            with self._lock:
                self._drain()

    def transfer(self, seconds: float, source: str, target: str) -> None:
        """The clock moved ``seconds`` of ``source`` to ``target``: relabel the held stretch's
        tail (only the averager's matchmaking -> allreduce split is shown; others are ignored)."""
        with self._lock:
            self._drain()
            held = self._held
            if held is None or held[0] != source or seconds <= 0:
                return
            split_s = max(held[1], held[2] - seconds)
            end_s, held[2] = held[2], split_s
            if split_s > held[1]:
                self._release_held()
            self._held = [target, split_s, end_s]

    def epoch(self, epoch: int, start_s: float, end_s: float, args: dict[str, Any]) -> None:
        """A slice on the epochs track for ``epoch``, which ran from ``start_s`` to ``end_s``."""
        with self._lock:
            self._drain()
            self._span(f"epoch {epoch}", EPOCHS_TID, start_s, end_s, {"epoch": epoch, **args})

    def counter(self, name: str, t_s: float, values: dict[str, float]) -> None:
        """A counter sample (a Perfetto counter track per name and key)."""
        with self._lock:
            self._drain()
            if self._origin_s is None or not self._room(phase=False):
                return
            self._event({"name": name, "ph": "C", "ts": self._ts(t_s), "args": values})

    def flush(self) -> None:
        """Write the events collected so far (a killed peer loses less)."""
        with self._lock:
            self._drain()
            self._write_batch()

    def close(self) -> None:
        """Write the held stretches and the closing bracket; safe to call twice."""
        with self._lock:
            if self._file is None:
                return
            self._drain()
            self._release_held()
            self._release_round()
            self._write_raw("\n]\n")
            self._write_batch()
            self._file.close()
            self._file = None

    # ---- internals (the caller holds the lock) ---------------------------------------------

    def _drain(self) -> None:
        # popleft, not a swap of lists: a segment appended by another thread while this runs
        # is either taken here or stays queued for the next drain, never lost
        pending = self._pending
        while pending:
            self._add_segment(*pending.popleft())

    def _add_segment(self, phase: str, start_s: float, end_s: float) -> None:
        if self._origin_s is None:
            self._origin_s = start_s
        held = self._held
        if held is not None and held[0] == phase and held[2] == start_s:
            held[2] = end_s
            return
        self._release_held()
        self._held = [phase, start_s, end_s]

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        phase, start_s, end_s = held
        self._emit_phase(phase, start_s, end_s)
        if phase in _COMM:
            if self._round is None:
                self._round = [start_s, end_s, {}]
            self._round[1] = end_s
            self._round[2][phase] = self._round[2].get(phase, 0.0) + (end_s - start_s)
        else:
            self._release_round()

    def _release_round(self) -> None:
        stretch, self._round = self._round, None
        if stretch is not None:
            start_s, end_s, seconds = stretch
            args = {f"{phase}_s": round(s, 6) for phase, s in seconds.items()}
            self._span("round", ROUNDS_TID, start_s, end_s, args)

    def _emit_phase(self, phase: str, start_s: float, end_s: float) -> None:
        if self.phases_stopped or self._file is None:
            return
        if phase == "other" and end_s - start_s < self.min_other_s:
            return
        if not self._room(phase=True):
            self.phases_stopped = True
            note = f"phase slices stop here: the trace reached {self.max_bytes} bytes"
            self._event(
                {"name": note, "ph": "i", "s": "g", "ts": self._ts(start_s), "tid": PHASES_TID}
            )
            return
        # hand-formatted: this runs on every phase boundary, json.dumps would be several times
        # slower; phase names are plain identifiers
        ts, dur = self._ts(start_s), (end_s - start_s) * 1e6
        self._write_event(
            f'{{"name":"{phase}","ph":"X","ts":{ts:.3f},"dur":{dur:.3f},'
            f'"pid":{self._pid},"tid":{PHASES_TID}}}'
        )

    def _span(self, name: str, tid: int, start_s: float, end_s: float, args: dict) -> None:
        if self._origin_s is None or self._file is None or not self._room(phase=False):
            return
        event = {
            "name": name,
            "ph": "X",
            "ts": self._ts(start_s),
            "dur": round((end_s - start_s) * 1e6, 3),
            "tid": tid,
            "args": args,
        }
        self._event(event)

    def _room(self, *, phase: bool) -> bool:
        return self.num_bytes < (self.max_bytes if phase else 2 * self.max_bytes)

    def _ts(self, t_s: float) -> float:
        origin_s = t_s if self._origin_s is None else self._origin_s
        return round((t_s - origin_s) * 1e6, 3)

    def _meta(self, name: str, tid: int, args: dict) -> None:
        self._event({"name": name, "ph": "M", "ts": 0, "tid": tid, "args": args})

    def _event(self, event: dict) -> None:
        event.setdefault("pid", self._pid)
        event.setdefault("tid", PHASES_TID)
        self._write_event(json.dumps(event, separators=(",", ":")))

    def _write_event(self, text: str) -> None:
        self._write_raw(text if self._first else ",\n" + text)
        self._first = False
        self.num_events += 1

    def _write_raw(self, text: str) -> None:
        # every event is ASCII (json.dumps escapes the rest), so characters count bytes
        if self._file is None:
            return
        self._batch.append(text)
        self._batch_bytes += len(text)
        self.num_bytes += len(text)
        if self._batch_bytes >= WRITE_BATCH_BYTES:
            self._write_batch()

    def _write_batch(self) -> None:
        if self._file is None or not self._batch:
            return
        data = memoryview("".join(self._batch).encode("ascii"))
        self._batch.clear()
        self._batch_bytes = 0
        while data:  # a raw write may take only part of it
            written = self._file.write(data)
            data = data[written or 0 :]
