"""``peer bench profiler``: what profiling costs a training step.

One process, one model, one optimizer, the same pre-drawn batches of the synthetic task, in
blocks of steps that alternate (plain, profiled, profiled, plain, ...) so that a machine whose
load drifts affects both sides alike:

* plain: a hand-written PyTorch step (to device, forward, loss, backward, ``optimizer.step``,
  ``zero_grad``), no clock at all;
* profiled: :meth:`peer.trainer.Trainer.train_step` with a :class:`peer.profiler.Profiler`'s
  clock, a trace file, the metrics stream and a rolling summary every ``sample_interval_s``:
  everything a peer with ``--trace`` and ``--metrics-file`` does per step (the DHT record is
  built from the same rolling summary on the event loop, off the training thread).

``overhead_ratio`` is the median over repetitions of (profiled block time / plain block time);
the median of paired ratios shrugs off the blocks that another process's burst slowed down.
Mixed precision is off on both sides, and a GPU is synchronized at block ends only.

Result fields: ``overhead_ratio, step_ms_plain, step_ms_profiled, fractions {phase: share of the
profiled blocks' wall time}, repetitions, steps_per_block, threads, device, task, trace_bytes,
trace_events``.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dht.transport import ByteCounters
from peer.device import select_device
from peer.metrics_stream import MetricsStream
from peer.phases import PHASES
from peer.profiler import Profiler, ProfilerConfig, StepProgress
from peer.tasks import DataShard, load_task
from peer.trainer import Trainer, TrainerConfig

TASK = "synthetic"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfilerBenchConfig:
    """One ``peer bench profiler`` run.

    Attributes:
        repetitions: pairs of blocks (one plain, one profiled).
        steps_per_block: training steps per block.
        warmup_steps: untimed steps of each kind first.
        num_threads: torch intra-op threads.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        num_batches: distinct batches drawn up front and cycled through.
        sample_interval_s: seconds between rolling summaries in profiled blocks.
        metrics_interval_s: seconds between metrics lines in profiled blocks.
    """

    repetitions: int = 30
    steps_per_block: int = 20
    warmup_steps: int = 20
    num_threads: int = 1
    device: str = "cpu"
    num_batches: int = 16
    sample_interval_s: float = 0.5
    metrics_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("repetitions", "steps_per_block", "num_threads", "num_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


class _Bench:
    """The two kinds of blocks over one model; see the module docstring."""

    def __init__(self, config: ProfilerBenchConfig, directory: Path):
        self.config = config
        self.task = load_task(TASK)
        self.device = select_device(config.device)
        model = self.task.build_model()
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        self.profiler = Profiler(
            ProfilerConfig(
                interval_s=config.sample_interval_s,
                window_s=config.sample_interval_s,
                trace_path=directory / "trace.json",
                log_verdicts=False,
            )
        )
        self.clock = self.profiler.clock
        self.trainer = Trainer(
            self.task,
            model,
            self.optimizer,
            shard=DataShard(seed=0),
            config=TrainerConfig(device=str(self.device), amp="off"),
            clock=self.clock,
        )
        self.model = self.trainer.model
        self.profiler.attach(
            progress=lambda: StepProgress(0, self.trainer.total_samples),
            device=str(self.device),
        )
        self.metrics = MetricsStream(
            directory / "metrics.jsonl",
            peer_id="bench",
            run_id="bench-profiler",
            clock=self.clock,
            counters=ByteCounters(),
            interval_s=config.metrics_interval_s,
        )
        loader = self.task.make_loader(DataShard(seed=0))
        self.batches = itertools.cycle(list(itertools.islice(loader, config.num_batches)))
        self.profiled_seconds = dict.fromkeys(PHASES, 0.0)
        self._next_sample_s = time.perf_counter() + config.sample_interval_s

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def plain(self, num_steps: int) -> float:
        """Seconds for ``num_steps`` hand-written steps."""
        model, optimizer, loss_fn = self.model, self.optimizer, self.task.loss_fn
        device, batches = self.device, self.batches
        self._sync()
        start = time.perf_counter()
        for _ in range(num_steps):
            inputs, targets = next(batches)
            inputs, targets = inputs.to(device), targets.to(device)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self._sync()
        return time.perf_counter() - start

    def profiled(self, num_steps: int) -> float:
        """Seconds for ``num_steps`` steps through the trainer with everything profiling on."""
        clock, trainer, metrics, batches = self.clock, self.trainer, self.metrics, self.batches
        before = clock.snapshot().seconds
        self._sync()
        start = time.perf_counter()
        for _ in range(num_steps):
            with clock.phase("data"):
                batch = next(batches)
            report = trainer.train_step(batch)
            metrics.maybe_report(
                epoch=0, step=report.step, samples=report.samples, loss=report.loss_tensor
            )
            if time.perf_counter() >= self._next_sample_s:
                self.profiler.sample()
                self._next_sample_s += self.config.sample_interval_s
        self._sync()
        elapsed_s = time.perf_counter() - start
        after = clock.snapshot().seconds
        for phase in PHASES:
            self.profiled_seconds[phase] += after[phase] - before[phase]
        return elapsed_s

    def close(self) -> None:
        self.metrics.close()
        self.profiler.close()
        self.trainer.close()


def run_profiler_bench(config: ProfilerBenchConfig | None = None) -> dict:
    """Run the benchmark; returns the result fields (see the module docstring)."""
    config = config or ProfilerBenchConfig()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    try:
        with tempfile.TemporaryDirectory(prefix="vp-bench-profiler-") as directory:
            bench = _Bench(config, Path(directory))
            try:
                bench.plain(config.warmup_steps)
                bench.profiled(config.warmup_steps)
                bench.profiled_seconds = dict.fromkeys(PHASES, 0.0)
                plain_s, profiled_s = [], []
                for repetition in range(config.repetitions):
                    if repetition % 2 == 0:
                        plain_s.append(bench.plain(config.steps_per_block))
                        profiled_s.append(bench.profiled(config.steps_per_block))
                    else:
                        profiled_s.append(bench.profiled(config.steps_per_block))
                        plain_s.append(bench.plain(config.steps_per_block))
            finally:
                bench.close()
            trace = bench.profiler.trace
            trace_bytes, trace_events = trace.num_bytes, trace.num_events
    finally:
        torch.set_num_threads(previous_threads)
    ratios = [p / q for p, q in zip(profiled_s, plain_s, strict=True)]
    wall_s = sum(bench.profiled_seconds.values())
    steps = config.steps_per_block
    return {
        "overhead_ratio": round(statistics.median(ratios), 4),
        "step_ms_plain": round(1e3 * statistics.median(plain_s) / steps, 4),
        "step_ms_profiled": round(1e3 * statistics.median(profiled_s) / steps, 4),
        "fractions": {p: round(s / wall_s, 4) for p, s in bench.profiled_seconds.items()},
        "repetitions": config.repetitions,
        "steps_per_block": steps,
        "threads": config.num_threads,
        "device": str(bench.device),
        "task": TASK,
        "trace_bytes": trace_bytes,
        "trace_events": trace_events,
    }
