"""``peer experiment``: run experiment sweeps and write their reports.

Registered by :mod:`peer.cli`. This module imports only argparse at import time (``peer --help``
stays fast); the rest comes when a subcommand runs.
"""

from __future__ import annotations

import argparse


def add_experiment_command(sub) -> None:
    """Add ``peer experiment`` to the ``peer`` command's subparsers."""
    parser = sub.add_parser("experiment", help="controlled multi-peer experiments and reports")
    parser.set_defaults(run=_not_yet)


def _not_yet(args: argparse.Namespace) -> int:
    raise SystemExit("peer: error: peer experiment is not built yet")
