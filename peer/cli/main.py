"""The ``peer`` command: the composition root that wires every subcommand.

Only this module imports ``monitor`` and ``experiments`` (and only inside the subcommands that
need them), so the layers below stay free of them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from dht.errors import ConfigError, DHTError, IdentityError
from experiments.command import add_experiment_command
from monitor.command import add_monitor_command
from peer.cli import bench as commands_bench
from peer.cli import bench_allreduce as commands_bench_allreduce
from peer.cli import bench_swarm as commands_bench_swarm
from peer.cli import dht as commands_dht
from peer.cli import experiment as commands_experiment
from peer.cli import hivemind as commands_hivemind
from peer.cli import join as commands_join
from peer.cli import profile as commands_profile


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``peer: error: ...``) and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="peer",
        description="Volunteer Peer: train neural networks together over the internet.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: INFO)",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )
    commands_join.add_join_command(sub)
    commands_dht.add_dht_command(sub)
    commands_dht.add_demo_command(sub)
    commands_profile.add_profile_command(sub)
    add_monitor_command(sub, backends={"hivemind": commands_hivemind.open_monitor_records})
    add_experiment_command(sub, watch=commands_experiment.watch_configuration)
    bench = sub.add_parser("bench", help="benchmarks that print one JSON object")
    bench_sub = bench.add_subparsers(
        dest="bench", required=True, parser_class=_Parser, metavar="BENCH"
    )
    commands_dht.add_bench_dht_command(bench_sub)
    commands_bench_allreduce.add_bench_allreduce_command(bench_sub)
    commands_bench.add_bench_train_command(bench_sub)
    commands_bench.add_bench_compare_command(bench_sub)
    commands_bench_swarm.add_bench_swarm_command(bench_sub)
    commands_profile.add_bench_profiler_command(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``peer`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.run(args) or 0
    except (ConfigError, IdentityError) as e:
        sys.stderr.write(f"peer: error: {e}\n")
        return 2
    except DHTError as e:
        sys.stderr.write(f"peer: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
