"""What a lone peer costs per step, in microseconds, against a plain loop in the same process.

``python -m peer.bench.lone_overhead [--threads 2] [--blocks 16] [--steps 640] [--json]``
builds a :class:`peer.run.runner.PeerRun` that joins no swarm (its DHT, loop thread, state
server, progress and profile publishing all run) and, beside it, the plain loop of
:mod:`peer.bench.baseline_run` on the same task (synthetic, 2048 samples per optimizer step, a
metrics line every 0.25 s on both sides). Blocks of ``--steps`` steps of each take turns (plain,
peer, peer, plain, ...); the overhead is the median over pairs of (peer - plain) microseconds
per step, with its quartiles. Both sides share one process, so the peer's background threads run
during the plain blocks too: the per-thread CPU time of all threads but the training thread
(``other_threads_cpu_us_per_step``, torch's own workers included on both sides) and the training
thread's wait for a CPU (``main_cpu_wait_us_per_step``, from schedstat) say how much of the
overhead is work on other threads. On a crowded host, where wall-clock pairs drown in other
processes' load, the CPU time of the training thread itself (``main_cpu_us_per_step``, and the
median over pairs of peer minus plain, ``main_cpu_overhead_us_*``) and of the other threads
(``other_threads_cpu_overhead_us_p50``) still say what the peer adds per step.
``--no-digest`` hands no snapshot to the state server (what serving the state costs a lone
peer; for attribution only: a peer must serve).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from dht.net.transport import ByteCounters
from peer.profiling.metrics_stream import MetricsStream
from peer.profiling.phases import PhaseClock
from peer.run.config import PeerConfig
from peer.run.runner import PeerRun
from peer.train.allocator import steady_allocator
from peer.train.device import to_device
from peer.train.tasks import DataShard

WARMUP_STEPS = 200


def _threads_schedstat() -> dict[int, tuple[int, int]]:
    """Every thread of this process: (ns on a CPU, ns waiting for one)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
            out[int(tid)] = (int(run_ns), int(wait_ns))
        except (OSError, ValueError):
            pass
    return out


class _PlainLoop:
    """The loop of :mod:`peer.bench.baseline_run`: phase clock, metrics stream, micro-batches."""

    def __init__(self, task, directory: Path, target_batch_size: int):
        self.task = task
        self.model = task.build_model()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.num_micro = max(1, math.ceil(target_batch_size / task.batch_size))
        self.clock = PhaseClock()
        self.stream = MetricsStream(
            directory / "plain.jsonl",
            peer_id="baseline",
            run_id="lone-overhead",
            clock=self.clock,
            counters=ByteCounters(),
            interval_s=0.25,
        )
        loader = task.make_loader(DataShard(seed=0), num_workers=0, pin_memory=False)
        self.batches = iter(loader)
        self.step = self.micro = self.epoch = 0

    def run(self, num_steps: int) -> None:
        clock, model, task = self.clock, self.model, self.task
        for _ in range(num_steps):
            with clock.phase("data"):
                inputs, targets = to_device(next(self.batches), torch.device("cpu"))
            with clock.phase("forward"):
                loss = task.loss_fn(model(inputs), targets)
            with clock.phase("backward"):
                (loss / self.num_micro).backward()
            self.step, self.micro = self.step + 1, self.micro + 1
            if self.micro == self.num_micro:
                with clock.phase("optimizer"):
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.epoch, self.micro = self.epoch + 1, 0
            self.stream.maybe_report(
                epoch=self.epoch, step=self.step, samples=len(targets), loss=loss.detach()
            )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict:
    steady_allocator()
    with tempfile.TemporaryDirectory(prefix="vp-lone-overhead-") as name:
        return _run_in(args, Path(name))


def _run_in(args: argparse.Namespace, directory: Path) -> dict:
    peer = PeerRun(
        PeerConfig(
            task="synthetic",
            target_batch_size=args.target_batch_size,
            torch_threads=args.threads,
            metrics_file=directory / "peer.jsonl",
            metrics_interval=0.25,
        )
    )
    peer.start()
    try:
        if args.no_digest:
            peer.services.state_server.update = lambda snapshot: None
        peer._before_training()
        plain = _PlainLoop(peer.task, directory, args.target_batch_size)
        stop = threading.Event()

        def peer_block(num_steps: int) -> None:
            trainer = peer.trainer
            trainer.run(max_steps=trainer.step + num_steps, stop_event=stop, on_step=peer._on_step)

        kinds = {"plain": plain.run, "peer": peer_block}
        main_tid = threading.get_native_id()
        for block in kinds.values():
            block(WARMUP_STEPS)
        us = {kind: [] for kind in kinds}
        others = {kind: [] for kind in kinds}
        waits = {kind: [] for kind in kinds}
        mains = {kind: [] for kind in kinds}
        for repetition in range(args.blocks):
            order = list(kinds) if repetition % 2 == 0 else list(reversed(kinds))
            for kind in order:
                before, start = _threads_schedstat(), time.perf_counter()
                kinds[kind](args.steps)
                elapsed, after = time.perf_counter() - start, _threads_schedstat()
                us[kind].append(1e6 * elapsed / args.steps)
                other_ns = sum(
                    now[0] - before[tid][0]
                    for tid, now in after.items()
                    if tid != main_tid and tid in before
                )
                others[kind].append(other_ns / 1e3 / args.steps)
                waits[kind].append((after[main_tid][1] - before[main_tid][1]) / 1e3 / args.steps)
                mains[kind].append((after[main_tid][0] - before[main_tid][0]) / 1e3 / args.steps)
        peer._after_training()
        epochs = peer.epoch
        plain.stream.close()
    finally:
        peer.close()
    diffs = [p - q for p, q in zip(us["peer"], us["plain"], strict=True)]
    ratios = [q / p for p, q in zip(us["peer"], us["plain"], strict=True)]
    main_diffs = [p - q for p, q in zip(mains["peer"], mains["plain"], strict=True)]
    other_diffs = [p - q for p, q in zip(others["peer"], others["plain"], strict=True)]

    def medians(values: dict[str, list[float]]) -> dict[str, float]:
        return {kind: round(statistics.median(v), 1) for kind, v in values.items()}

    return {
        "threads": args.threads,
        "steps_per_block": args.steps,
        "num_pairs": args.blocks,
        "no_digest": args.no_digest,
        "step_us_plain": medians(us)["plain"],
        "step_us_peer": medians(us)["peer"],
        "overhead_us_p50": round(statistics.median(diffs), 1),
        "overhead_us_q25": round(_quantile(diffs, 0.25), 1),
        "overhead_us_q75": round(_quantile(diffs, 0.75), 1),
        "ratio_p50": round(statistics.median(ratios), 4),
        "main_cpu_us_per_step": medians(mains),
        "main_cpu_overhead_us_p50": round(statistics.median(main_diffs), 1),
        "main_cpu_overhead_us_q25": round(_quantile(main_diffs, 0.25), 1),
        "main_cpu_overhead_us_q75": round(_quantile(main_diffs, 0.75), 1),
        "other_threads_cpu_us_per_step": medians(others),
        "other_threads_cpu_overhead_us_p50": round(statistics.median(other_diffs), 1),
        "main_cpu_wait_us_per_step": medians(waits),
        "epochs": epochs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.bench.lone_overhead")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both sides)")
    parser.add_argument("--blocks", type=int, default=16, help="pairs of blocks")
    parser.add_argument("--steps", type=int, default=640, help="steps per block")
    parser.add_argument("--target-batch-size", type=int, default=2048)
    parser.add_argument("--no-digest", action="store_true", help="serve no state (attribution)")
    parser.add_argument("--json", action="store_true", help="one JSON object (the default)")
    args = parser.parse_args(argv)
    if min(args.threads, args.blocks, args.steps, args.target_batch_size) < 1:
        parser.error("--threads, --blocks, --steps and --target-batch-size must be >= 1")
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
