"""``peer experiment``: run experiment sweeps and write their reports.

Registered by :mod:`peer.cli.main`. This module imports only argparse at import time (``peer
--help``
stays fast); the rest comes when a subcommand runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def add_experiment_command(sub, *, watch: Callable | None = None) -> None:
    """Add ``peer experiment`` (run, report, cleanup) to the ``peer`` command's subparsers.

    Args:
        sub: the subparsers.
        watch: the live dashboard of a running swarm configuration (an
            :data:`experiments.watching.Watch`), shown when stdout is a terminal unless
            ``--no-dashboard``; None: the progress bar only.
    """
    parser = sub.add_parser(
        "experiment",
        help="controlled multi-peer experiments and reports",
        description="Sweeps of multi-peer runs (local, network-emulated or on SSH hosts) "
        "against a single-node baseline, and their reports. See docs/EXPERIMENTS.md.",
    )
    commands = parser.add_subparsers(
        dest="experiment", required=True, parser_class=type(parser), metavar="ACTION"
    )
    run = commands.add_parser(
        "run",
        help="run every configuration of a spec, then write the report",
        description="Run every configuration of SPEC (TOML) into DIR/<config>/; finished "
        "configurations are skipped unless --force; then write DIR/report.md.",
    )
    run.add_argument("spec", metavar="SPEC.toml", type=Path, help="the experiment file")
    run.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    run.add_argument("--force", action="store_true", help="rerun finished configurations")
    run.add_argument(
        "--no-dashboard",
        action="store_true",
        help="no live dashboard of the running configuration, the progress bar only "
        "(default: shown when stdout is a terminal; q closes it, Ctrl-C stops the sweep)",
    )
    run.set_defaults(run=_run, watch=watch)
    report = commands.add_parser(
        "report",
        help="write DIR/report.md, plots and CSV tables from a sweep's metrics",
        description="Read DIR/<config>/*.jsonl (the metrics streams) and write DIR/report.md, "
        "DIR/plots/*.png and DIR/tables/*.csv.",
    )
    report.add_argument("dir", metavar="DIR", type=Path, help="a sweep's output directory")
    report.add_argument(
        "--target-loss", type=float, default=None, help="override the spec's stop.target_loss"
    )
    report.set_defaults(run=_report)
    cleanup = commands.add_parser(
        "cleanup",
        help="remove network namespaces and links left by an interrupted netns run",
        description="Stop the processes in, and delete, every network namespace an "
        "experiment created (names starting with vpx-); needs root.",
    )
    cleanup.set_defaults(run=_cleanup)


def _run(args: argparse.Namespace) -> int:
    from dht.errors import ConfigError
    from experiments.launch.base import LaunchError
    from experiments.report.writer import write_report
    from experiments.spec import SpecError, load_spec
    from experiments.sweep import run_sweep

    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    watch = None if args.no_dashboard or not sys.stdout.isatty() else args.watch
    try:
        outcomes = run_sweep(spec, args.spec.read_text(), args.out, force=args.force, watch=watch)
    except LaunchError as e:
        sys.stderr.write(f"peer: error: {e}\n")
        return 1
    report = write_report(args.out)
    print(f"report: {report}")
    return 1 if any(o is not None and o.status != "done" for o in outcomes.values()) else 0


def _report(args: argparse.Namespace) -> int:
    from dht.errors import ConfigError
    from experiments.report.writer import write_report
    from experiments.spec import SpecError

    if not (args.dir / "spec.toml").is_file():
        raise ConfigError(f"{args.dir} holds no spec.toml: not a `peer experiment run` directory")
    try:
        report = write_report(args.dir, target_loss=args.target_loss)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    print(f"report: {report}")
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    import os
    import shutil

    from experiments.launch.netns import cleanup_all

    if shutil.which("ip") is None:
        sys.stderr.write("peer: error: `ip` (iproute2) is missing: no namespaces to clean up\n")
        return 1
    if os.geteuid() != 0:
        sys.stderr.write("peer: error: deleting network namespaces needs root\n")
        return 1
    removed = cleanup_all()
    print(f"removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else ""))
    return 0
