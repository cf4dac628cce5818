"""The single-node baseline of an experiment, as a process that writes the metrics stream.

``python -m peer.bench.baseline_run --metrics-file F ...`` trains the task with a plain PyTorch loop
(the loop of :mod:`peer.bench.baseline`: ``target_batch_size / batch_size`` accumulated
micro-batches,
each loss divided by their number, then one optimizer step) on all the CPUs it is given, and writes
the DESIGN.md metrics stream so that experiment reports read it exactly as they read the peers'.
The phase clock only brackets data, forward, backward and optimizer; ``epoch`` is the number of
optimizer steps taken (one swarm epoch is one optimizer step too), ``net`` is always zero.
SIGTERM or SIGINT ends the run after the current step, with a last metrics line. The summary (the
last line of stdout) holds ``epoch, num_steps, num_samples, final_loss`` (the last micro-batch's),
``recent_loss`` (the mean over the last ``RECENT_LOSS_SAMPLES`` samples, as a peer's
``final_loss``) and ``eval_loss``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import signal
import sys
import threading
import time

import torch

from dht.gc_policy import settle as settle_gc
from dht.net.transport import ByteCounters
from peer.profiling.metrics_stream import MetricsStream
from peer.profiling.phases import PhaseClock
from peer.train.allocator import steady_allocator
from peer.train.device import select_device, to_device
from peer.train.schedules import make_lr_schedule
from peer.train.tasks import DataShard, TaskError, load_task
from peer.train.trainer import evaluate

OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
RECENT_LOSS_SAMPLES = 2048


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m peer.bench.baseline_run",
        description="Plain PyTorch single-process training that writes the metrics stream.",
    )
    parser.add_argument("--task", default="synthetic", help="task name (default: synthetic)")
    parser.add_argument("--task-option", action="append", default=[], help="KEY=VALUE")
    parser.add_argument("--target-batch-size", type=int, default=2048, help="samples per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"])
    parser.add_argument("--warmup-epochs", type=int, default=0)
    parser.add_argument("--min-lr-ratio", type=float, default=0.0)
    parser.add_argument("--max-time", type=float, default=None, help="seconds to train")
    parser.add_argument("--max-epochs", type=int, default=None, help="optimizer steps to take")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, auto")
    parser.add_argument("--seed", type=int, default=0, help="data seed")
    parser.add_argument("--run-id", default="baseline", help="the run field of metrics lines")
    parser.add_argument("--metrics-file", required=True, help="JSON Lines metrics stream")
    parser.add_argument("--metrics-interval", type=float, default=5.0, help="seconds per line")
    return parser


def train(args: argparse.Namespace, stop: threading.Event) -> dict:
    """Train until ``--max-time``, ``--max-epochs`` or ``stop``; returns a summary."""
    torch.set_num_threads(args.torch_threads)
    steady_allocator()  # as the peers it is compared with (peer.train.allocator)
    settle_gc()  # and their collector's policy (dht.gc_policy)
    options = dict(option.split("=", 1) for option in args.task_option)
    task = load_task(args.task, options)
    device = select_device(args.device)
    model = task.build_model().to(device)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr)
    schedule = make_lr_schedule(
        args.lr_schedule or "constant",
        warmup_epochs=args.warmup_epochs,
        total_epochs=args.max_epochs,
        min_lr_ratio=args.min_lr_ratio,
    )
    num_micro = max(1, math.ceil(args.target_batch_size / task.batch_size))
    clock = PhaseClock()
    stream = MetricsStream(
        args.metrics_file,
        peer_id="baseline",
        run_id=args.run_id,
        clock=clock,
        counters=ByteCounters(),
        interval_s=args.metrics_interval,
    )
    loader = task.make_loader(
        DataShard(seed=args.seed), num_workers=args.num_workers, pin_memory=False
    )
    batches = iter(loader)
    # the last RECENT_LOSS_SAMPLES samples' losses: ``recent_loss``, as a peer's final_loss
    recent = collections.deque(maxlen=max(1, math.ceil(RECENT_LOSS_SAMPLES / task.batch_size)))
    deadline = time.monotonic() + (args.max_time or math.inf)
    step = epoch = micro = samples = 0
    loss = None
    try:
        while time.monotonic() < deadline and not stop.is_set():
            if args.max_epochs is not None and epoch >= args.max_epochs:
                break
            with clock.phase("data"):
                inputs, targets = to_device(next(batches), device)
            with clock.phase("forward"):
                loss = task.loss_fn(model(inputs), targets)
            with clock.phase("backward"):
                (loss / num_micro).backward()
            recent.append(loss.detach())
            step, micro, samples = step + 1, micro + 1, samples + len(targets)
            if micro == num_micro:
                with clock.phase("optimizer"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                epoch, micro = epoch + 1, 0
                if schedule is not None:
                    for group in optimizer.param_groups:
                        group["lr"] = args.lr * schedule(epoch)
            stream.maybe_report(epoch=epoch, step=step, samples=len(targets), loss=loss.detach())
        stream.report(epoch=epoch, step=step, loss=None if loss is None else loss.detach())
    finally:
        stream.close()
    return {
        "epoch": epoch,
        "num_steps": step,
        "num_samples": samples,
        "final_loss": None if loss is None else float(loss.detach()),
        "recent_loss": float(torch.stack(list(recent)).mean()) if recent else None,
        "eval_loss": evaluate(task, model, device=device),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_time is None and args.max_epochs is None:
        sys.stderr.write("peer.bench.baseline_run: error: give --max-time or --max-epochs\n")
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        summary = train(args, stop)
    except (TaskError, ValueError) as e:
        sys.stderr.write(f"peer.bench.baseline_run: error: {e}\n")
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
