"""``peer bench swarm``: N light peers with the real DHT, progress and averaging on loopback (the
harness lives in :mod:`peer.bench.swarm`); ``--simulate`` runs the virtual-clock simulation of
:mod:`peer.bench.swarm_sim` instead."""

from __future__ import annotations

import argparse
import json
import sys

from averaging.config import AveragerConfig
from dht.errors import ConfigError
from dht.options import positive_float, positive_int
from peer.swarm.progress_config import progress_default


def _at_least_2(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("a swarm needs at least 2 peers")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_bench_swarm_command(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "swarm",
        help="N light peers (real DHT, progress, matchmaking, all-reduce) on loopback",
        description="Start N light peers on 127.0.0.1, packed --peers-per-process to a "
        "process, each with its own keys, port and DHT node, the real progress tracker and "
        "averager. Training is a stand-in: samples accumulate at each peer's rate toward the "
        "target batch size, and each epoch's gradient is a seeded random vector of --size "
        "values, so every averaged replica is checked against the exact weighted mean in "
        "float64. Reports round times, how many ready peers averaged in a group, the "
        "replicas' spread, DHT bytes per node, CPU and memory per peer. The last line of "
        "stdout is one JSON object.",
    )
    parser.add_argument("--peers", type=_at_least_2, default=16, help="peers (default: 16)")
    parser.add_argument(
        "--size", type=positive_int, default=1000, help="float32 values per peer (default: 1000)"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=5, help="measured epochs (default: 5)"
    )
    parser.add_argument(
        "--seconds",
        type=positive_float,
        default=None,
        help="run this long instead of --rounds (the epoch the stop cuts is not measured)",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=_non_negative_int,
        default=1,
        help="first epochs not measured (default: 1)",
    )
    parser.add_argument("--peers-per-process", type=positive_int, default=32, help="default: 32")
    parser.add_argument(
        "--target-group-size",
        type=_at_least_2,
        default=16,
        help="the averager's largest group (default: 16)",
    )
    parser.add_argument(
        "--samples-per-s",
        type=positive_float,
        default=32.0,
        help="a peer's mean rate; each peer has 0.5x to 1.5x of it (default: 32)",
    )
    parser.add_argument(
        "--target-batch-size",
        type=positive_int,
        default=None,
        help="samples per epoch across the swarm (default: --epoch-s of the summed rate)",
    )
    parser.add_argument(
        "--epoch-s", type=positive_float, default=8.0, help="see --target-batch-size (default: 8)"
    )
    parser.add_argument(
        "--step-s", type=positive_float, default=0.5, help="one local step, s (default: 0.5)"
    )
    parser.add_argument(
        "--publish-interval-s",
        type=positive_float,
        default=2.0,
        help="progress publishing interval, s (default: 2)",
    )
    parser.add_argument(
        "--read-replicas",
        type=positive_int,
        default=progress_default("read_replicas"),
        help="progress reads merge this many replicas of a bucket (default: "
        f"{progress_default('read_replicas') or 'all'}, as ProgressConfig)",
    )
    parser.add_argument(
        "--store-replicas",
        type=positive_int,
        default=progress_default("store_replicas"),
        help="progress records are stored on this many replicas of a bucket (default: "
        f"{progress_default('store_replicas') or 'all'}, as ProgressConfig)",
    )
    parser.add_argument(
        "--matchmaking-read-replicas",
        type=positive_int,
        default=AveragerConfig().read_replicas,
        help="matchmaking reads merge this many replicas of the key (default: "
        f"{AveragerConfig().read_replicas}, as AveragerConfig; 20 merges every one)",
    )
    parser.add_argument(
        "--matchmaking-store-replicas",
        type=positive_int,
        default=AveragerConfig().store_replicas,
        help="matchmaking announcements go to this many replicas of the key (default: "
        f"{AveragerConfig().store_replicas or 'all'}, as AveragerConfig)",
    )
    parser.add_argument(
        "--max-publish-gap-s",
        type=positive_float,
        default=progress_default("max_publish_gap_s"),
        help="store a progress record only when readers would learn something, at least every "
        f"this many s (default: {progress_default('max_publish_gap_s') or 'every interval'}, "
        "as ProgressConfig)",
    )
    parser.add_argument(
        "--max-keys-read-per-interval",
        type=positive_int,
        default=progress_default("max_keys_read_per_interval"),
        help="progress reads take at most this many bucket keys per interval on average: a "
        "layout of more keys is read every few intervals (default: "
        f"{progress_default('max_keys_read_per_interval') or 'every interval'}, as "
        "ProgressConfig)",
    )
    parser.add_argument(
        "--matchmaking-time-s",
        type=positive_float,
        default=None,
        help="the averager's matchmaking bound, s (default: 5, or peers / 5 when larger)",
    )
    parser.add_argument(
        "--min-deadline-s",
        type=positive_float,
        default=None,
        help="floor of the averager's adaptive waits, s (default: 1, or peers / 32 when larger)",
    )
    parser.add_argument(
        "--rpc-timeout-s",
        type=positive_float,
        default=None,
        help="one DHT request's bound, s (default: 5, or peers / 16 when larger)",
    )
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    parser.add_argument(
        "--shared-address",
        action="store_true",
        help="every peer on 127.0.0.1, one source address to each node's limits per address "
        "(default: each peer its own loopback address, 127.1.x.y)",
    )
    parser.add_argument(
        "--timeout-s", type=positive_float, default=None, help="bound on the whole run"
    )
    parser.add_argument(
        "--log-level", default="ERROR", help="the peers' log level, to stderr (default: ERROR)"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="run the virtual-clock simulation (peer.bench.swarm_sim) for --seconds "
        "(default 60) instead of real peers",
    )
    parser.add_argument(
        "--churn-per-s",
        type=float,
        default=0.0,
        help="with --simulate: peers leaving and joining per second (default: 0)",
    )
    parser.add_argument(
        "--busy-s",
        type=float,
        default=0.0,
        help="with --simulate: a busy host, each peer's refresh cycle up to this many seconds "
        "late (default: 0)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_swarm)


def _simulate(args: argparse.Namespace) -> dict | None:
    try:
        from peer.bench.swarm_sim import simulate
    except ImportError as e:
        print(
            f"peer bench swarm --simulate: the simulation is not available ({e})", file=sys.stderr
        )
        return None
    try:
        return simulate(
            args.peers,
            seconds=args.seconds if args.seconds is not None else 60.0,
            churn_per_s=args.churn_per_s,
            seed=args.seed,
            target_group_size=args.target_group_size,
            busy_s=args.busy_s,
        )
    except ValueError as e:
        raise ConfigError(f"peer bench swarm --simulate: {e}") from None


def run_bench_swarm(args: argparse.Namespace) -> int:
    if args.simulate:
        result = _simulate(args)
        if result is None:
            return 2
    else:
        from peer.bench.swarm import SwarmBenchConfig, run_swarm_bench

        try:
            config = SwarmBenchConfig(
                num_peers=args.peers,
                size=args.size,
                num_rounds=args.rounds,
                seconds=args.seconds,
                num_warmup_rounds=args.warmup_rounds,
                peers_per_process=args.peers_per_process,
                target_group_size=args.target_group_size,
                samples_per_s=args.samples_per_s,
                target_batch_size=args.target_batch_size,
                epoch_s=args.epoch_s,
                step_s=args.step_s,
                publish_interval_s=args.publish_interval_s,
                read_replicas=args.read_replicas,
                store_replicas=args.store_replicas,
                matchmaking_read_replicas=args.matchmaking_read_replicas,
                matchmaking_store_replicas=args.matchmaking_store_replicas,
                max_publish_gap_s=args.max_publish_gap_s,
                max_keys_read_per_interval=args.max_keys_read_per_interval,
                matchmaking_time_s=args.matchmaking_time_s,
                min_deadline_s=args.min_deadline_s,
                rpc_timeout_s=args.rpc_timeout_s,
                seed=args.seed,
                shared_address=args.shared_address,
                timeout_s=args.timeout_s,
                log_level=args.log_level,
            )
        except ValueError as e:
            raise ConfigError(f"peer bench swarm: {e}") from None
        result = run_swarm_bench(config)
    if not args.json:
        for name, value in result.items():
            if name != "round_details":
                print(f"{name:>32}: {value}")
    print(json.dumps(result))
    return 0
