"""``peer bench allreduce``: the averaging benchmark (its harness lives in ``averaging.bench``)."""

from __future__ import annotations

import argparse
import json

from dht.errors import ConfigError
from peer.cli_args import positive_float, positive_int


def _group_size(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("an all-reduce needs at least 2 peers")
    return value


def add_bench_allreduce_command(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "allreduce",
        help="N peer processes on loopback average S values; round timings",
        description="Start N peer processes on 127.0.0.1, each holding S random float32 values "
        "with a random weight; run rounds of matchmaking + butterfly all-reduce and "
        "compare with the exact weighted mean in float64. The last line of stdout is "
        "one JSON object.",
    )
    parser.add_argument("--peers", type=_group_size, default=2, help="peers, >= 2 (default: 2)")
    parser.add_argument(
        "--size",
        type=positive_int,
        default=1_000_000,
        help="float32 values per peer (default: 1000000)",
    )
    parser.add_argument(
        "--compression",
        choices=["none", "fp16", "uint8"],
        default="none",
        help="wire format (default: none)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=5,
        help="measured rounds after one warm-up (default: 5)",
    )
    parser.add_argument(
        "--backend",
        choices=["native", "hivemind"],
        default="native",
        help="native, or hivemind's DecentralizedAverager ([hivemind] extra) (default: native)",
    )
    parser.add_argument("--phases", action="store_true", help="also report seconds per phase")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_allreduce)


def run_bench_allreduce(args: argparse.Namespace) -> int:
    if args.backend == "hivemind":
        from peer.hivemind_bench import run_hivemind_allreduce_bench

        result = run_hivemind_allreduce_bench(args.peers, args.size, args.compression, args.rounds)
    else:
        from averaging.bench import run_allreduce_bench

        result = run_allreduce_bench(
            args.peers, args.size, args.compression, args.rounds, include_phases=args.phases
        )
    if not args.json:
        for name, value in result.items():
            print(f"{name:>20}: {value}")
    print(json.dumps(result))
    return 0



def add_bench_train_command(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "train",
        help="N peer processes against one plain PyTorch loop: samples/s and loss",
        description="Train the task with one plain PyTorch process using all cores (the "
        "baseline), then with N `peer join` processes on loopback whose torch threads sum to the "
        "same cores, each for --seconds. The defaults are the benchmark contract. The last line "
        "of stdout is one JSON object.",
    )
    parser.add_argument("--peers", type=positive_int, default=2, help="peers (default: 2)")
    parser.add_argument("--task", default="synthetic", help="task (default: synthetic)")
    parser.add_argument(
        "--task-option", action="append", default=[], help="task option KEY=VALUE (repeatable)"
    )
    parser.add_argument(
        "--seconds", type=positive_float, default=20.0, help="training seconds (default: 20)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=None, help="samples per local step"
    )
    parser.add_argument(
        "--target-batch-size",
        type=positive_int,
        default=2048,
        help="samples per optimizer step (default: 2048)",
    )
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="Adam lr (default: 1e-3)")
    parser.add_argument(
        "--mode", choices=["grad", "params", "diloco"], default="grad", help="default: grad"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="cores to use (default: all)"
    )
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=None,
        help="train this many optimizer steps instead of --seconds (statistical efficiency)",
    )
    parser.add_argument(
        "--lr-schedule", choices=["constant", "linear", "cosine"], default="constant"
    )
    parser.add_argument("--warmup-epochs", type=int, default=0, help="LR warmup (default: 0)")
    parser.add_argument(
        "--min-lr-ratio", type=float, default=0.0, help="final LR / --lr of the decay"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline")
    parser.add_argument(
        "--backend", choices=["native", "hivemind"], default="native", help="default: native"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_train)


def run_bench_train(args: argparse.Namespace) -> int:
    from peer.bench_train import TrainBenchConfig, run_train_bench

    for option in args.task_option:
        if "=" not in option:
            raise ConfigError(f"--task-option: {option!r} is not KEY=VALUE")
    extra = {} if args.threads is None else {"num_threads": args.threads}
    config = TrainBenchConfig(
        backend=args.backend,
        num_peers=args.peers,
        task=args.task,
        task_options=tuple(args.task_option),
        seconds=args.seconds,
        batch_size=args.batch_size,
        target_batch_size=args.target_batch_size,
        lr=args.lr,
        mode=args.mode,
        run_baseline=not args.no_baseline,
        epochs=args.epochs,
        lr_schedule=args.lr_schedule,
        warmup_epochs=args.warmup_epochs,
        min_lr_ratio=args.min_lr_ratio,
        **extra,
    )
    result = run_train_bench(config)
    if not args.json:
        for name, value in result.items():
            print(f"{name:>26}: {value}")
    print(json.dumps(result))
    return 0
