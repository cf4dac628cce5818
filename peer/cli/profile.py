"""``peer profile summarize`` (the breakdown of metrics files) and ``peer bench profiler``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dht.errors import ConfigError
from dht.options import positive_float, positive_int


def add_profile_command(sub) -> None:
    parser = sub.add_parser(
        "profile",
        help="where a run's time went, from metrics files",
        description="Read what peers wrote with --metrics-file.",
    )
    profile_sub = parser.add_subparsers(
        dest="profile", required=True, parser_class=type(parser), metavar="ACTION"
    )
    summarize = profile_sub.add_parser(
        "summarize",
        help="per-peer and swarm phase breakdown and bottleneck verdict",
        description="Add up the JSON Lines metrics streams of one or many peers (a whole "
        "experiment's files): seconds per phase, samples/s, network rates and the bottleneck "
        "verdict, per peer and for the swarm. Lines that do not match the documented fields "
        "are counted and skipped.",
    )
    summarize.add_argument("files", nargs="+", metavar="METRICS.jsonl", help="metrics files")
    summarize.add_argument("--json", action="store_true", help="print one JSON object instead")
    summarize.set_defaults(run=run_summarize)


def _summary_json(summary, **extra) -> dict:
    verdict = summary.verdict()
    return {
        **extra,
        "wall_s": summary.wall_s,
        "seconds": summary.seconds,
        "fractions": summary.fractions(),
        "samples": summary.samples,
        "samples_per_s": summary.samples_per_s,
        "sent_bytes_per_s": summary.sent_bytes_per_s,
        "recv_bytes_per_s": summary.recv_bytes_per_s,
        "cpu_percent": summary.cpu_percent,
        "rss_bytes": summary.rss_bytes,
        "bottleneck": verdict.bottleneck,
        "verdict": verdict.text,
    }


def run_summarize(args: argparse.Namespace) -> int:
    from rich.console import Console

    from peer.profiling.metrics_reader import aggregate, read_metrics, summarize_lines
    from peer.profiling.summary import peers_table

    try:
        found = read_metrics(args.files)
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename}: {e.strerror}") from None
    for path, count in found.num_bad_lines.items():
        sys.stderr.write(f"peer profile: skipped {count} invalid line(s) in {path} ")
        sys.stderr.write(f"(first: {found.errors[path]})\n")
    if not found.peers:
        raise ConfigError(f"no valid metrics lines in {', '.join(args.files)}")
    peers = {peer: summarize_lines(lines) for peer, lines in sorted(found.peers.items())}
    swarm = aggregate(peers.values())
    if args.json:
        result = {
            "peers": [
                _summary_json(
                    summary,
                    peer=peer,
                    epoch=found.peers[peer][-1].epoch,
                    num_lines=len(found.peers[peer]),
                )
                for peer, summary in peers.items()
            ],
            "swarm": _summary_json(swarm, num_peers=len(peers)),
        }
        print(json.dumps(result))
        return 0
    console = Console()
    rows = [(peer[:8], summary) for peer, summary in peers.items()]
    console.print(peers_table(rows, title="per peer: % of each peer's wall time per phase"))
    console.print(
        peers_table(
            [(f"{len(peers)} peer{'s' if len(peers) > 1 else ''}", swarm)],
            title="swarm: % of all peer-seconds; rates summed over peers",
        )
    )
    for peer, summary in peers.items():
        console.print(f"[bold]{peer[:8]}[/bold]: {summary.verdict().text}")
    console.print(f"[bold]swarm[/bold]: {swarm.verdict().text}")
    return 0


def add_bench_profiler_command(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "profiler",
        help="the profiler's overhead: step time with profiling on / off",
        description="Train the synthetic task in this process in short blocks of three kinds "
        "taking turns, on the same model and batches: the trainer with the whole profiler on "
        "(phase clock, trace file, metrics stream, rolling summaries), the same trainer with "
        "profiling off, and a hand-written PyTorch loop. overhead_ratio is the median over "
        "repetitions of (on block time / off block time), vs_pytorch_ratio that of on / "
        "hand-written. The last line of stdout is one JSON object.",
    )
    parser.add_argument(
        "--repetitions", type=positive_int, default=200, help="block pairs (default: 200)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=5, help="steps per block (default: 5)"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (1)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    parser.add_argument(
        "--sample-interval",
        type=positive_float,
        default=None,
        help="seconds between rolling summaries (default: a peer's --profile-interval, 5)",
    )
    parser.add_argument(
        "--metrics-interval",
        type=positive_float,
        default=None,
        help="seconds between metrics lines (default: a peer's --metrics-interval, 5)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_profiler)


def run_bench_profiler(args: argparse.Namespace) -> int:
    from peer.bench.profiler import ProfilerBenchConfig, run_profiler_bench

    try:
        config = ProfilerBenchConfig(
            repetitions=args.repetitions,
            steps_per_block=args.steps,
            num_threads=args.threads,
            device=args.device,
        )
        if args.sample_interval is not None:
            config = dataclasses.replace(config, sample_interval_s=args.sample_interval)
        if args.metrics_interval is not None:
            config = dataclasses.replace(config, metrics_interval_s=args.metrics_interval)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    result = run_profiler_bench(config)
    if not args.json:
        for name, value in result.items():
            print(f"{name:>20}: {value}")
    print(json.dumps(result))
    return 0
