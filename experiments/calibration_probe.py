"""One calibration setting, measured: ``python -m experiments.calibration_probe ...``.

Trains the task with the single-node baseline's loop (micro-batches accumulated to the target
batch size, then one optimizer step; :mod:`peer.bench.baseline_run`) for ``--warmup-s`` seconds
unmeasured (after the loader workers' first batches), then ``--measure-s`` seconds measured,
and prints one JSON line: ``{"samples_per_s": ..., "num_samples": ..., "elapsed_s": ...}``.
The OpenMP wait policy comes from the environment (it is read once, when OpenMP starts) and the
CPUs from the caller's ``taskset``, so that the probe runs exactly as the process it stands for.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from peer.train.allocator import steady_allocator
from peer.train.tasks import DataShard, TaskError, load_task


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.calibration_probe")
    parser.add_argument("--task", default="synthetic")
    parser.add_argument("--task-option", action="append", default=[], help="KEY=VALUE")
    parser.add_argument("--target-batch-size", type=int, default=2048)
    parser.add_argument("--torch-threads", type=int, required=True)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--measure-s", type=float, default=6.0)
    return parser


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Train as the baseline does; samples/s over the measured stretch."""
    torch.set_num_threads(args.torch_threads)
    steady_allocator()
    task = load_task(args.task, dict(option.split("=", 1) for option in args.task_option))
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    num_micro = max(1, math.ceil(args.target_batch_size / task.batch_size))
    batches = iter(task.make_loader(DataShard(seed=0), num_workers=args.num_workers))
    # The warm-up lasts warmup_s and at least until the loader's workers have each delivered
    # their prefetched batches (their start-up is no part of the steady rate).
    warmup_batches = 2 + 2 * args.num_workers
    for _ in range(warmup_batches):
        next(batches)
    start = time.monotonic()
    measure_from = start + args.warmup_s
    deadline = measure_from + args.measure_s
    micro = samples = 0
    measured_start: float | None = None
    while (now := time.monotonic()) < deadline:
        if measured_start is None and now >= measure_from:
            measured_start, samples = now, 0
        inputs, targets = next(batches)
        loss = task.loss_fn(model(inputs), targets)
        (loss / num_micro).backward()
        micro, samples = micro + 1, samples + len(targets)
        if micro == num_micro:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            micro = 0
    if measured_start is None:  # the warm-up took the whole time: measure all of it
        measured_start = start
    elapsed_s = time.monotonic() - measured_start
    return {"samples_per_s": samples / elapsed_s, "num_samples": samples, "elapsed_s": elapsed_s}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = measure(args)
    except (TaskError, ValueError) as e:
        sys.stderr.write(f"calibration probe: error: {e}\n")
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
