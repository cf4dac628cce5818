"""``peer bench allreduce``: the averaging benchmark (its harness lives in ``averaging.bench``)."""

from __future__ import annotations

import argparse
import json

from peer.commands_dht import _positive_int


def _group_size(text: str) -> int:
    value = _positive_int(text)
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
        type=_positive_int,
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
        type=_positive_int,
        default=5,
        help="measured rounds after one warm-up (default: 5)",
    )
    parser.add_argument(
        "--backend",
        choices=["native"],
        default="native",
        help="native only until the hivemind backend lands",
    )
    parser.add_argument("--phases", action="store_true", help="also report seconds per phase")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_allreduce)


def run_bench_allreduce(args: argparse.Namespace) -> int:
    from averaging.bench import run_allreduce_bench

    result = run_allreduce_bench(
        args.peers, args.size, args.compression, args.rounds, include_phases=args.phases
    )
    if not args.json:
        for name, value in result.items():
            print(f"{name:>20}: {value}")
    print(json.dumps(result))
    return 0
