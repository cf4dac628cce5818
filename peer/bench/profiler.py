"""``peer bench profiler``: what profiling costs a training step.

One process, one model, one optimizer, the same pre-drawn batches of the synthetic task, in
short blocks of steps of three kinds that take turns (plain, off, on, on, off, plain, ...) so that
a machine whose load drifts affects every kind alike:

* ``on``: :meth:`peer.train.trainer.Trainer.run`, as a peer trains, with a
  :class:`peer.profiling.profiler.Profiler`'s clock, a trace file, the metrics stream and a rolling
  summary every ``sample_interval_s``: everything a peer with ``--trace`` and ``--metrics-file``
  does per step, at a peer's default intervals (``--profile-interval``, ``--metrics-interval``;
  a peer builds its summaries on the event loop, the bench between two steps, which costs the
  training thread at least as much);
* ``off``: the same trainer with profiling off (:class:`peer.profiling.phases.NullClock`, no trace,
  no
  metrics stream, no summaries);
* ``plain``: a hand-written PyTorch step (forward, loss, backward, ``optimizer.step``,
  ``zero_grad``), the floor for any training loop.

``overhead_ratio`` (what profiling costs) is the median over repetitions of (on block time / off
block time); ``vs_pytorch_ratio`` is the same for on / plain (profiling plus everything the
trainer's loop adds: stop checks, the step hook, reports). Their spread over the pairs
(:mod:`peer.bench.pairs`) comes as ``overhead_ratio_iqr``, ``overhead_ratio_min``,
``overhead_ratio_max`` (the same with ``vs_pytorch_``) and ``num_pairs``: a ratio whose IQR
straddles a budget has not shown that it meets it. Medians of paired ratios shrug off the
blocks that another process's burst slowed down; short blocks pair them closely in time. Mixed
precision is off on every side, and a GPU is synchronized at block ends only.

glibc's malloc returns the step's large tensors to the kernel and faults them back in (about a
thousand page faults per step here), at thresholds it keeps adapting to the process's history;
that noise swamps a one-percent difference. The benchmark therefore fixes those thresholds for
its own process, as a peer does (:mod:`peer.train.allocator`; every kind of block runs under the
same
allocator).

Result fields: ``overhead_ratio, vs_pytorch_ratio`` (and their spread), ``step_ms_plain,
step_ms_off, step_ms_profiled, fractions {phase: share of the profiled blocks' wall time},
repetitions, steps_per_block, threads, device, task, trace_bytes, trace_events``.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dht.net.transport import ByteCounters
from peer.bench.pairs import RatioSpread, pairwise_ratios, spread
from peer.profiling.metrics_stream import METRICS_INTERVAL_S, MetricsStream
from peer.profiling.phases import PHASES, NullClock
from peer.profiling.profiler import Profiler, ProfilerConfig, StepProgress
from peer.train.allocator import steady_allocator
from peer.train.device import select_device
from peer.train.tasks import DataShard, load_task
from peer.train.trainer import StepReport, Trainer, TrainerConfig

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
        sample_interval_s: seconds between rolling summaries in profiled blocks (a peer's
            ``--profile-interval`` by default).
        metrics_interval_s: seconds between metrics lines in profiled blocks (a peer's
            ``--metrics-interval`` by default).
    """

    repetitions: int = 200
    steps_per_block: int = 5
    warmup_steps: int = 20
    num_threads: int = 1
    device: str = "cpu"
    num_batches: int = 16
    sample_interval_s: float = ProfilerConfig.interval_s
    metrics_interval_s: float = METRICS_INTERVAL_S

    def __post_init__(self) -> None:
        for name in ("repetitions", "steps_per_block", "num_threads", "num_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sample_interval_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
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
        self.null_clock = NullClock()
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

    def off(self, num_steps: int) -> float:
        """Seconds for ``num_steps`` steps of :meth:`Trainer.run` with profiling off."""
        trainer = self.trainer
        trainer.clock = self.null_clock
        try:
            self._sync()
            start = time.perf_counter()
            trainer.run(max_steps=trainer.step + num_steps, batches=self.batches)
            self._sync()
            return time.perf_counter() - start
        finally:
            trainer.clock = self.clock

    def profiled(self, num_steps: int) -> float:
        """Seconds for ``num_steps`` steps of :meth:`Trainer.run` with everything profiling on."""
        clock, trainer = self.clock, self.trainer
        before = clock.snapshot().seconds
        self._sync()
        start = time.perf_counter()
        trainer.run(max_steps=trainer.step + num_steps, on_step=self._on_step, batches=self.batches)
        self._sync()
        elapsed_s = time.perf_counter() - start
        after = clock.snapshot().seconds
        for phase in PHASES:
            self.profiled_seconds[phase] += after[phase] - before[phase]
        return elapsed_s

    def _on_step(self, report: StepReport) -> None:
        # what a peer does per step for its profiler: the metrics stream and rolling summaries
        self.metrics.maybe_report(
            epoch=0, step=report.step, samples=report.samples, loss=report.loss_tensor
        )
        if time.perf_counter() >= self._next_sample_s:
            self.profiler.sample()
            self._next_sample_s += self.config.sample_interval_s

    def close(self) -> None:
        self.metrics.close()
        self.profiler.close()
        self.trainer.close()


def run_profiler_bench(config: ProfilerBenchConfig | None = None) -> dict:
    """Run the benchmark; returns the result fields (see the module docstring)."""
    config = config or ProfilerBenchConfig()
    steady_allocator()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    try:
        with tempfile.TemporaryDirectory(prefix="vp-bench-profiler-") as directory:
            bench = _Bench(config, Path(directory))
            kinds = {"plain": bench.plain, "off": bench.off, "on": bench.profiled}
            try:
                for run_block in kinds.values():
                    run_block(config.warmup_steps)
                bench.profiled_seconds = dict.fromkeys(PHASES, 0.0)
                block_s: dict[str, list[float]] = {kind: [] for kind in kinds}
                for repetition in range(config.repetitions):
                    order = list(kinds) if repetition % 2 == 0 else list(reversed(kinds))
                    for kind in order:
                        block_s[kind].append(kinds[kind](config.steps_per_block))
            finally:
                bench.close()
            trace = bench.profiler.trace
            trace_bytes, trace_events = trace.num_bytes, trace.num_events
    finally:
        torch.set_num_threads(previous_threads)
    wall_s = sum(bench.profiled_seconds.values())
    steps = config.steps_per_block

    def ratios(kind: str, baseline: str) -> RatioSpread:
        return spread(pairwise_ratios(block_s[kind], block_s[baseline]))

    overhead, vs_pytorch = ratios("on", "off"), ratios("on", "plain")

    def step_ms(kind: str) -> float:
        return round(1e3 * statistics.median(block_s[kind]) / steps, 4)

    return {
        "overhead_ratio": round(overhead.ratio_p50, 4),
        "vs_pytorch_ratio": round(vs_pytorch.ratio_p50, 4),
        **_spread_fields("overhead", overhead),
        **_spread_fields("vs_pytorch", vs_pytorch),
        "step_ms_plain": step_ms("plain"),
        "step_ms_off": step_ms("off"),
        "step_ms_profiled": step_ms("on"),
        "fractions": {p: round(s / wall_s, 4) for p, s in bench.profiled_seconds.items()},
        "repetitions": config.repetitions,
        "steps_per_block": steps,
        "sample_interval_s": config.sample_interval_s,
        "metrics_interval_s": config.metrics_interval_s,
        "threads": config.num_threads,
        "device": str(bench.device),
        "task": TASK,
        "trace_bytes": trace_bytes,
        "trace_events": trace_events,
    }


def _spread_fields(name: str, ratios: RatioSpread) -> dict[str, float | int]:
    """``{name}_ratio_iqr``, ``_min``, ``_max`` and ``num_pairs`` (the per-pair list is long)."""
    fields = ratios.fields()
    return {
        f"{name}_ratio_iqr": fields["ratio_iqr"],
        f"{name}_ratio_min": fields["ratio_min"],
        f"{name}_ratio_max": fields["ratio_max"],
        "num_pairs": fields["num_pairs"],
    }
