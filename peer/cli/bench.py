"""``peer bench train`` and ``peer bench compare``: the training benchmarks (their harnesses live
in :mod:`peer.bench`); ``peer bench allreduce`` is in :mod:`peer.cli.bench_allreduce`.
"""

from __future__ import annotations

import argparse
import json

from dht.errors import ConfigError
from dht.options import positive_float, positive_int


def add_bench_train_command(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "train",
        help="N peer processes against one plain PyTorch loop: samples/s and loss",
        description="Train the task with N `peer join` processes on loopback whose torch "
        "threads sum to the machine's cores, and with one plain PyTorch loop using all cores "
        "(the baseline), each for --seconds, in alternate windows of about --window seconds "
        "(the side not measured is paused); ratio_p50 is the median of the windows' pairwise "
        "ratios, with ratio_iqr, ratio_min and ratio_max. The defaults are the benchmark "
        "contract. The last line of stdout is one JSON object.",
    )
    parser.add_argument("--peers", type=positive_int, default=2, help="peers (default: 2)")
    parser.add_argument("--task", default="synthetic", help="task (default: synthetic)")
    parser.add_argument(
        "--task-option", action="append", default=[], help="task option KEY=VALUE (repeatable)"
    )
    parser.add_argument(
        "--seconds", type=positive_float, default=40.0, help="training seconds (default: 40)"
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
        "--delay-update",
        action="store_true",
        help="the peers run each round while the next epoch computes (grad mode, native)",
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
    parser.add_argument(
        "--window",
        type=positive_float,
        default=1.0,
        help="seconds of each measured window, at most 2 (default: 1; --seconds 40 gives 40 "
        "pairs of windows)",
    )
    parser.add_argument(
        "--baseline",
        choices=["matched", "single"],
        default="matched",
        help="matched (default): one plain loop per peer with its threads and data seed, rates "
        "summed; single: one plain loop with all the cores (the same with --peers 1)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline")
    parser.add_argument(
        "--backend", choices=["native", "hivemind"], default="native", help="default: native"
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="run the benchmark this many times and report the run with the median ratio, "
        "with every run's ratio (default: 1)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_train)


def run_bench_train(args: argparse.Namespace) -> int:
    from peer.bench.train import run_train_bench_repeated
    from peer.bench.train_config import TrainBenchConfig

    for option in args.task_option:
        if "=" not in option:
            raise ConfigError(f"--task-option: {option!r} is not KEY=VALUE")
    extra = {} if args.threads is None else {"num_threads": args.threads}
    try:
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
            delay_update=args.delay_update,
            run_baseline=not args.no_baseline,
            epochs=args.epochs,
            lr_schedule=args.lr_schedule,
            warmup_epochs=args.warmup_epochs,
            min_lr_ratio=args.min_lr_ratio,
            window_s=args.window,
            baseline=args.baseline,
            **extra,
        )
    except ValueError as e:
        raise ConfigError(f"peer bench train: {e}") from None
    result = run_train_bench_repeated(config, args.repeat)
    if not args.json:
        for name, value in result.items():
            print(f"{name:>26}: {value}")
    print(json.dumps(result))
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    """``1000000,10000000`` -> (1000000, 10000000); ``none`` -> ()."""
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 2,4") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _name_list(choices: tuple[str, ...] | None = None):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        bad = [n for n in names if choices is not None and n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices or ())}")
        return names

    return parse


def add_bench_compare_command(bench_sub) -> None:
    from peer.bench.compare import PARTS, CompareConfig

    full = CompareConfig()
    parser = bench_sub.add_parser(
        "compare",
        help="the same workloads on native and hivemind in one run; Markdown tables",
        description="Run peer bench allreduce, train and dht on both backends, one after "
        "another in this run, and print Markdown tables (for docs/BENCHMARKS.md) with the "
        "exact command of every cell and the native/hivemind ratios. The defaults are the "
        "full sweep (long: an hour or more on 2 cores); --quick is a smoke run of a minute.",
    )
    parser.add_argument(
        "--parts", type=_name_list(PARTS), default=full.parts, help="default: allreduce,train,dht"
    )
    parser.add_argument("--sizes", type=_int_list, default=full.sizes, help="all-reduce sizes")
    parser.add_argument(
        "--allreduce-peers", type=_int_list, default=full.allreduce_peers, help="default: 2,4"
    )
    parser.add_argument(
        "--compressions",
        type=_name_list(("none", "fp16", "uint8")),
        default=full.compressions,
        help="default: none,fp16,uint8",
    )
    parser.add_argument("--rounds", type=positive_int, default=full.rounds, help="default: 3")
    parser.add_argument(
        "--train-peers", type=_int_list, default=full.train_peers, help="default: 1,2,4"
    )
    parser.add_argument(
        "--tasks", type=_name_list(), default=full.tasks, help="default: synthetic,charlm"
    )
    parser.add_argument(
        "--train-seconds", type=positive_float, default=full.train_seconds, help="default: 20"
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="default: all cores")
    parser.add_argument("--dht-nodes", type=positive_int, default=full.dht_nodes)
    parser.add_argument("--dht-keys", type=positive_int, default=full.dht_keys)
    parser.add_argument(
        "--pairs",
        type=positive_int,
        default=full.pairs,
        help="runs of each cell per backend, the backends taking turns; the ratio is the "
        f"median of the pairs' ratios (default: {full.pairs})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: all-reduce of 10000 values, 2 peers, no compression, 1 round; "
        "DHT of 3 nodes; no training; 1 pair (overrides those options)",
    )
    parser.add_argument("--out", default=None, help="also write the Markdown to this file")
    parser.add_argument("--json", action="store_true", help="last line: the results as JSON")
    parser.set_defaults(run=run_bench_compare)


def run_bench_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from peer.bench.compare import CompareConfig, run_compare
    from peer.bench.compare_markdown import render_markdown

    options = {
        "parts": args.parts,
        "sizes": args.sizes,
        "allreduce_peers": args.allreduce_peers,
        "compressions": args.compressions,
        "rounds": args.rounds,
        "train_peers": args.train_peers,
        "tasks": args.tasks,
        "train_seconds": args.train_seconds,
        "threads": args.threads,
        "dht_nodes": args.dht_nodes,
        "dht_keys": args.dht_keys,
        "pairs": args.pairs,
    }
    if args.quick:
        options |= {
            "parts": tuple(p for p in args.parts if p != "train"),
            "sizes": (10_000,),
            "allreduce_peers": (2,),
            "compressions": ("none",),
            "rounds": 1,
            "dht_nodes": 3,
            "dht_keys": 5,
            "pairs": 1,
        }
    try:
        config = CompareConfig(**options)
    except ValueError as e:
        raise ConfigError(f"peer bench compare: {e}") from None
    report = run_compare(config)
    markdown = render_markdown(report)
    if args.out:
        Path(args.out).write_text(markdown, encoding="utf-8")
    print(markdown)
    if args.json:
        print(json.dumps(report))
    return 0
