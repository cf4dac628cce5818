"""``peer bench allreduce``: the averaging benchmark (its harness lives in
``averaging.bench.allreduce``).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

from dht.errors import ConfigError
from dht.options import positive_float, positive_int


def _group_size(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("an all-reduce needs at least 2 peers")
    return value


def _percent(text: str) -> float:
    value = float(text)
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"must be a percentage in [0, 100), got {text}")
    return value


def _streams(text: str) -> int:
    from averaging.bounds import MAX_STREAMS_PER_PAIR  # numpy: only when the option is given

    value = int(text)
    if not 0 <= value <= MAX_STREAMS_PER_PAIR:
        raise argparse.ArgumentTypeError(f"must be 0 (automatic) to {MAX_STREAMS_PER_PAIR}")
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
        "--aggregation",
        choices=["mean", "trimmed_mean", "centered_clip"],
        default="mean",
        help="how reducers combine contributions (native only; max_abs_err stays against the "
        "weighted mean) (default: mean)",
    )
    parser.add_argument(
        "--backend",
        choices=["native", "hivemind"],
        default="native",
        help="native, or hivemind's DecentralizedAverager ([hivemind] extra) (default: native)",
    )
    parser.add_argument("--phases", action="store_true", help="also report seconds per phase")
    parser.add_argument(
        "--compare",
        choices=["native", "hivemind"],
        default=None,
        help="also run this other backend, the two taking turns in --pairs pairs of runs; the "
        "JSON gets `compare`: its figures and the median of the pairs' round-time ratios "
        "(its round s / this backend's), with their spread",
    )
    parser.add_argument(
        "--pairs",
        type=positive_int,
        default=3,
        help="with --compare: runs per backend (default: 3)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument(
        "--latency-ms",
        type=positive_float,
        default=None,
        help="one-way delay between two peers, ms (RTT = 2x): each peer in its own network "
        "namespace behind an emulated link (root; native backend only)",
    )
    parser.add_argument(
        "--bandwidth-mbit",
        type=positive_float,
        default=None,
        help="each peer's link rate, Mbit/s, both directions (emulated as --latency-ms)",
    )
    parser.add_argument(
        "--loss-pct",
        type=_percent,
        default=None,
        help="packets lost between two peers, %% (emulated as --latency-ms)",
    )
    parser.add_argument(
        "--tcp-congestion",
        default=None,
        help="TCP congestion control in the peers' namespaces (emulated as --latency-ms), "
        "e.g. cubic, the default of most volunteers' systems (default: this host's)",
    )
    parser.add_argument(
        "--streams",
        type=_streams,
        default=0,
        help="streams (TCP connections) per sender and reducer, 1-8, or 0: chosen from the "
        "measured RTT and past goodput (native only) (default: 0)",
    )
    parser.set_defaults(run=run_bench_allreduce)


def _emulated_allreduce_bench(args: argparse.Namespace) -> dict:
    """The native bench with its peers in namespaces behind emulated links (``--latency-ms``,
    ``--bandwidth-mbit``, ``--loss-pct``); the result names the network it ran on."""
    from averaging.bench.allreduce import run_allreduce_bench
    from experiments.bench_network import emulated_places
    from experiments.launch.base import LaunchError

    try:
        with emulated_places(
            args.peers,
            latency_ms=args.latency_ms,
            bandwidth_mbit=args.bandwidth_mbit,
            loss_percent=args.loss_pct,
            tcp_congestion=args.tcp_congestion,
        ) as places:
            result = run_allreduce_bench(
                args.peers,
                args.size,
                args.compression,
                args.rounds,
                include_phases=args.phases,
                places=places,
                aggregation=args.aggregation,
                streams_per_pair=args.streams,
            )
    except LaunchError as e:
        raise ConfigError(f"--latency-ms/--bandwidth-mbit/--loss-pct: {e}") from None
    except ValueError as e:  # the network spec refused a value
        raise ConfigError(f"--tcp-congestion: {e}") from None
    return result | {
        "latency_ms": args.latency_ms,
        "bandwidth_mbit": args.bandwidth_mbit,
        "loss_pct": args.loss_pct,
        "tcp_congestion": args.tcp_congestion or _host_congestion_control(),
    }


def _host_congestion_control() -> str | None:
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return None


def allreduce_runner(args: argparse.Namespace, backend: str) -> Callable[[], dict]:
    """One ``peer bench allreduce`` run of ``backend`` with the options in ``args``."""
    emulated = any(
        x is not None
        for x in (args.latency_ms, args.bandwidth_mbit, args.loss_pct, args.tcp_congestion)
    )
    if backend == "hivemind":
        if emulated:
            raise ConfigError(
                "--latency-ms/--bandwidth-mbit/--loss-pct/--tcp-congestion: only with "
                "--backend native"
            )
        if args.streams:
            raise ConfigError("--streams: only with --backend native")
        from peer.hivemind.bench import run_hivemind_allreduce_bench

        return functools.partial(
            run_hivemind_allreduce_bench, args.peers, args.size, args.compression, args.rounds
        )
    if emulated:
        return functools.partial(_emulated_allreduce_bench, args)
    from averaging.bench.allreduce import run_allreduce_bench

    return functools.partial(
        run_allreduce_bench,
        args.peers,
        args.size,
        args.compression,
        args.rounds,
        include_phases=args.phases,
        aggregation=args.aggregation,
        streams_per_pair=args.streams,
    )


def run_bench_allreduce(args: argparse.Namespace) -> int:
    if args.compare is None:
        result = allreduce_runner(args, args.backend)()
    elif args.compare == args.backend:
        raise ConfigError(f"--compare {args.compare}: the same backend as --backend")
    else:
        from peer.bench.compare import paired_allreduce

        result = paired_allreduce(
            allreduce_runner(args, args.backend),
            allreduce_runner(args, args.compare),
            num_pairs=args.pairs,
        )
    if not args.json:
        for name, value in result.items():
            print(f"{name:>20}: {value}")
    print(json.dumps(result))
    return 0
