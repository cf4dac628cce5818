"""The profiler of a peer: its phase clock, trace, rolling and per-epoch summaries, verdict, the
profile record it publishes on the DHT, and the table it prints at exit.

One :class:`Profiler` per peer owns the :class:`~peer.profiling.phases.PhaseClock` every component
marks
(the trainer: data, h2d, forward, backward, optimizer; the collaborative optimizer: matchmaking,
allreduce; the runner: state_sync), so every second of the peer's life is in exactly one phase.
It reads the rest at *marks*: the clock's totals, samples trained, the transport's byte counters
and the process's CPU time. A summary is the difference between two marks:

* the rolling window: a mark every ``interval_s`` (the publisher's period), summaries over the
  last ``window_s`` seconds; this is what the DHT record and the log's verdict describe;
* per epoch: a mark at every swarm epoch boundary (``on_epoch``), kept for the last
  ``max_epochs_kept`` epochs and written as slices of the trace's epochs track;
* the whole run: from the clock's start, for the exit table.

Timing GPU work: by default a phase is charged the CPU time spent in it, so kernels queued by
``forward``/``backward`` are charged to whichever later phase waits for the GPU (the sum stays
exact; the split between compute phases can be off). ``synchronize=True`` waits for the GPU at
every boundary: each phase gets its own GPU work, at the cost of the CPU/GPU overlap (a few
percent on small models). See :mod:`peer.profiling.phases`.

Cost: the clock's boundary (about a microsecond) plus, with a trace, one formatted line per
stretch; marks happen every few seconds. ``peer bench profiler`` measures it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psutil
from rich.console import Console

from dht.kademlia.node import DHTNode
from dht.net.transport import ByteCounters
from dht.owned_record import OwnedRecord
from dht.runtime import EventLoopThread
from peer.profiling.phases import PHASES
from peer.profiling.profiled_clock import ProfiledClock
from peer.profiling.summary import StretchSummary, breakdown_table, nonnegative
from peer.profiling.trace import DEFAULT_MAX_BYTES, TraceWriter
from peer.records.buckets import record_key
from peer.records.profile import PROFILE_RECORDS_PER_BUCKET, ProfileRecord, profile_key

logger = logging.getLogger(__name__)
# A profile record outlives this many publishing periods (and at least MIN_PROFILE_TTL_S).
PROFILE_TTL_PERIODS = 4
MIN_PROFILE_TTL_S = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """Settings of the profiler.

    Attributes:
        interval_s: seconds between rolling summaries (and profile records on the DHT).
        window_s: seconds the rolling summary covers (at least one interval).
        trace_path: where to write the Chrome/Perfetto trace (None: no trace).
        trace_max_bytes: phase slices in the trace stop at this size; epochs and rounds go on
            up to twice it.
        synchronize_device: a device to wait for at every phase boundary (``cuda:0``; exact GPU
            phases, lost CPU/GPU overlap); None times asynchronously.
        max_epochs_kept: per-epoch summaries kept in memory.
        backend: ``native`` or ``hivemind`` (written in the record).
        log_verdicts: log the rolling verdict (INFO) whenever its bottleneck changes.
    """

    interval_s: float = 5.0
    window_s: float = 30.0
    trace_path: Path | None = None
    trace_max_bytes: int = DEFAULT_MAX_BYTES
    synchronize_device: str | None = None
    max_epochs_kept: int = 1000
    backend: str = "native"
    log_verdicts: bool = True

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and math.isfinite(self.interval_s)):
            raise ValueError(f"interval_s must be a positive number, got {self.interval_s}")
        if not self.window_s >= self.interval_s:
            raise ValueError(f"window_s ({self.window_s}) must be >= interval_s")
        if self.max_epochs_kept < 1:
            raise ValueError(f"max_epochs_kept must be >= 1, got {self.max_epochs_kept}")


class StepProgress(NamedTuple):
    """Where training is: the swarm epoch, samples trained so far, the last loss (or None)."""

    epoch: int
    total_samples: int
    loss: Any = None


@dataclasses.dataclass(frozen=True)
class _Mark:
    t_s: float  # the clock's time of the mark
    seconds: tuple[float, ...]  # the clock's totals, in PHASES order
    samples: int
    sent: int
    recv: int
    cpu_s: float


@dataclasses.dataclass(frozen=True)
class EpochSummary:
    """One swarm epoch as this peer lived it (``epoch`` is the epoch that ended)."""

    epoch: int
    summary: StretchSummary


def gpu_stats() -> dict[str, float] | None:
    """GPU memory (bytes) and utilization (percent, needs NVML) of the current device, or None
    without CUDA. torch is read only if the process already imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    stats: dict[str, float] = {
        "memory_allocated_bytes": torch.cuda.memory_allocated(),
        "memory_reserved_bytes": torch.cuda.memory_reserved(),
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
    }
    try:
        stats["utilization_percent"] = torch.cuda.utilization()
    except (ImportError, RuntimeError, ValueError):
        pass  # no NVML (pynvml) here: memory only
    return stats


async def _native_id() -> int:
    return threading.get_native_id()


def _as_loss(value: Any) -> float | None:
    if value is None:
        return None
    loss = float(value)  # a device tensor synchronizes here, every few seconds
    return loss if math.isfinite(loss) else None


class Profiler:
    """A peer's profiler; see the module docstring. ``close`` is safe twice.

    Args:
        config: settings.
        process_name: the trace's process name (e.g. ``peer 1a2b3c4d``).
        now: the clock's time source (tests inject a fake one).
    """

    def __init__(
        self,
        config: ProfilerConfig | None = None,
        *,
        process_name: str = "peer",
        now: Callable[[], float] = time.perf_counter,
    ):
        self.config = config or ProfilerConfig()
        self.trace: TraceWriter | None = None
        if self.config.trace_path is not None:
            self.trace = TraceWriter(
                self.config.trace_path,
                process_name=process_name,
                max_bytes=self.config.trace_max_bytes,
            )
        self.clock = ProfiledClock(
            now=now,
            synchronize=self._synchronizer(),
            listener=None if self.trace is None else self.trace.segment,
            on_transfer=None if self.trace is None else self.trace.transfer,
        )
        self.device = "cpu"
        self.epochs: collections.deque[EpochSummary] = collections.deque(
            maxlen=self.config.max_epochs_kept
        )
        self._lock = threading.Lock()
        self._process = psutil.Process()
        self._resources: tuple[int, dict[str, float] | None] | None = None
        self._progress: Callable[[], StepProgress] = lambda: StepProgress(0, 0)
        self._counters = ByteCounters()
        self._start = self._mark()
        self._window: collections.deque[_Mark] = collections.deque([self._start])
        self._epoch_mark = self._start
        self._last_bottleneck: str | None = None
        self.publisher: OwnedRecord | None = None
        self.last_record: ProfileRecord | None = None
        self._loop_thread: EventLoopThread | None = None

    def _synchronizer(self) -> Callable[[], None] | None:
        if self.config.synchronize_device is None:
            return None
        from peer.train.device import device_synchronize, select_device

        return device_synchronize(select_device(self.config.synchronize_device))

    def attach(
        self,
        *,
        progress: Callable[[], StepProgress],
        counters: ByteCounters | None = None,
        device: str = "cpu",
    ) -> None:
        """Where to read training progress and network bytes from (counted from now on)."""
        # marks taken before this one read no samples and no bytes, which was true then: the
        # bytes a transport sent while starting count in the first window
        with self._lock:
            self._progress = progress
            self._counters = counters if counters is not None else ByteCounters()
            self.device = device

    # ---- marks and summaries -------------------------------------------------------------------

    def _mark(self) -> _Mark:
        snapshot = self.clock.snapshot()
        progress = self._progress()
        return _Mark(
            t_s=self.clock.start_s + snapshot.wall_s,
            seconds=tuple(snapshot.seconds[p] for p in PHASES),
            samples=progress.total_samples,
            sent=self._counters.sent,
            recv=self._counters.recv,
            # all threads' user + system time, as psutil's cpu_times, without reading /proc
            cpu_s=time.process_time(),
        )

    def _between(self, first: _Mark, last: _Mark, *, fresh: bool = True) -> StretchSummary:
        # fresh=False reuses the last resident memory and GPU figures: an epoch boundary runs on
        # the training thread, where reading /proc (and NVML) every epoch costs a lone peer
        # about 0.3% of its throughput; the rolling window refreshes them every interval
        if fresh or self._resources is None:
            self._resources = (self._process.memory_info().rss, gpu_stats())
        rss_bytes, gpu = self._resources
        wall_s = last.t_s - first.t_s
        seconds = nonnegative(
            {p: b - a for p, a, b in zip(PHASES, first.seconds, last.seconds, strict=True)}
        )
        return StretchSummary(
            wall_s=wall_s,
            seconds=seconds,
            samples=last.samples - first.samples,
            sent_bytes=last.sent - first.sent,
            recv_bytes=last.recv - first.recv,
            cpu_percent=100 * (last.cpu_s - first.cpu_s) / wall_s if wall_s > 0 else 0.0,
            rss_bytes=rss_bytes,
            gpu=gpu,
        )

    def sample(self) -> StretchSummary:
        """Take a mark and summarize the rolling window that ends with it."""
        with self._lock:
            mark = self._mark()
            window = self._window
            window.append(mark)
            # keep the newest mark at or before the window's start, so the window is full
            while len(window) > 2 and window[1].t_s <= mark.t_s - self.config.window_s:
                window.popleft()
            summary = self._between(window[0], mark)
        if self.config.log_verdicts:
            self._log_verdict(summary)
        if self.trace is not None:
            self.trace.counter("samples/s", mark.t_s, {"samples/s": summary.samples_per_s})
            self.trace.counter(
                "network Mbit/s",
                mark.t_s,
                {
                    "sent": 8e-6 * summary.sent_bytes_per_s,
                    "recv": 8e-6 * summary.recv_bytes_per_s,
                },
            )
            self.trace.flush()
        return summary

    def _log_verdict(self, summary: StretchSummary) -> None:
        verdict = summary.verdict()
        if verdict.bottleneck != self._last_bottleneck and summary.wall_s > 0:
            self._last_bottleneck = verdict.bottleneck
            logger.info("profile over the last %.0f s: %s", summary.wall_s, verdict.text)

    def on_epoch(self, epoch: int) -> EpochSummary:
        """The swarm epoch is now ``epoch``: summarize the epoch that ended."""
        with self._lock:
            mark = self._mark()
            first, self._epoch_mark = self._epoch_mark, mark
            ended = EpochSummary(epoch - 1, self._between(first, mark, fresh=False))
            self.epochs.append(ended)
        if self.trace is not None:
            fractions = ended.summary.fractions()
            args: dict[str, Any] = {f"{p}_pct": round(100 * f, 2) for p, f in fractions.items()}
            args["samples"] = ended.summary.samples
            args["verdict"] = ended.summary.verdict().text
            self.trace.epoch(ended.epoch, first.t_s, mark.t_s, args)
        return ended

    def run_summary(self) -> StretchSummary:
        """The whole run so far (since the clock started)."""
        with self._lock:
            return self._between(self._start, self._mark())

    def make_record(self, *, peer_id: str, time_s: float) -> ProfileRecord:
        """The record to publish: the rolling window ending now."""
        summary = self.sample()
        progress = self._progress()
        verdict = summary.verdict()
        self.last_record = ProfileRecord(
            peer_id=peer_id,
            time=time_s,
            epoch=progress.epoch,
            window_s=summary.wall_s,
            fractions=summary.fractions(),
            samples_per_s=summary.samples_per_s,
            sent_bytes_per_s=summary.sent_bytes_per_s,
            recv_bytes_per_s=summary.recv_bytes_per_s,
            cpu_percent=summary.cpu_percent,
            rss_bytes=summary.rss_bytes,
            device=self.device,
            loss=_as_loss(progress.loss),
            bottleneck=verdict.bottleneck,
            verdict=verdict.text,
            backend=self.config.backend,
        )
        return self.last_record

    def print_summary(self, console: Console | None = None) -> StretchSummary:
        """Print the exit table (the whole run; stderr by default) and return its summary."""
        summary = self.run_summary()
        console = console or Console(stderr=True)
        columns = [("run", summary)]
        if self.epochs:
            last = self.epochs[-1]
            columns.append((f"epoch {last.epoch}", last.summary))
        console.print(breakdown_table(columns, title="where the time went"))
        console.print(f"verdict: {summary.verdict().text}")
        return summary

    def start_publishing(
        self,
        loop_thread: EventLoopThread,
        *,
        dht: DHTNode,
        run_id: str,
        peer_id: str,
        timeout_s: float,
        num_peers: Callable[[], float] = lambda: 1.0,
    ) -> None:
        """Publish the rolling summary on the DHT every ``interval_s`` until :meth:`close`.

        ``num_peers`` (called on the event loop) is this peer's count of the swarm: it picks
        the record's bucket (:mod:`peer.records.buckets`).
        """
        if self.publisher is not None:
            return

        def make_value(time_s: float) -> tuple[dict, float]:
            record = self.make_record(peer_id=peer_id, time_s=time_s)
            return record.to_wire(), record.time

        publisher = OwnedRecord(
            dht=dht,
            key=lambda: record_key(
                profile_key(run_id), peer_id, num_peers(), PROFILE_RECORDS_PER_BUCKET
            ),
            make_value=make_value,
            # a record outlives a few periods, so a late store does not blink the peer away
            ttl_s=max(PROFILE_TTL_PERIODS * self.config.interval_s, MIN_PROFILE_TTL_S),
            interval_s=self.config.interval_s,
            name="profile record",
        )
        loop_thread.run(publisher.__aenter__(), timeout_s=timeout_s)
        self.publisher, self._loop_thread = publisher, loop_thread
        # rounds run on the loop thread: its waits for a CPU in them are no communication
        self.clock.watch_threads(loop=loop_thread.run(_native_id(), timeout_s=timeout_s))

    def stop_publishing(self, *, timeout_s: float = 30.0) -> None:
        """Publish no more records (the last one stays until its TTL); safe twice.

        A peer calls this when its training ends: a window that reaches into the time after it
        (evaluating, printing, leaving) would give a peer that is done a bottleneck it never had
        while training.
        """
        publisher, self.publisher = self.publisher, None
        try:
            if publisher is not None and self._loop_thread is not None:
                self._loop_thread.run(publisher.close(), timeout_s=timeout_s)
        except Exception:  # the publisher is auxiliary: its failure must not block leaving
            logger.exception("the profile publisher failed")

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Stop publishing (before the DHT node closes) and finish the trace; safe twice."""
        try:
            self.stop_publishing(timeout_s=timeout_s)
        finally:
            if self.trace is not None:
                self.clock.snapshot()  # closes the open stretch, so the trace gets it
                self.trace.close()
            self.clock.close()
