"""``peer join``: the volunteer's command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading

from peer.run.flags import add_config_arguments, load_config


def add_join_command(sub) -> None:
    parser = sub.add_parser(
        "join",
        help="join (or start) a training run and train until stopped",
        description="Train a full replica of the run's model on this machine and average with "
        "the swarm. Options come from flags, --config FILE (TOML) and VP_* "
        "environment variables, in that order of precedence.",
    )
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="end with a JSON summary line")
    parser.set_defaults(run=run_join)


def dashboard_companion(config, stop: threading.Event):
    """``--dashboard``: the live view of this peer and its swarm, beside the training loop
    (q stops training; the peer then leaves as on Ctrl-C)."""
    from monitor.config import MonitorConfig
    from monitor.embed import peer_dashboard

    monitor_config = MonitorConfig(
        run_id=config.run_id,
        interval_s=max(0.5, config.publish_interval),
        target_batch_size=config.target_batch_size,
    )
    if config.backend == "hivemind":
        from peer.cli.hivemind import join_companion

        return join_companion(monitor_config, stop)

    def companion(run):
        return peer_dashboard(
            run.loop_thread,
            run.services.node,
            config=monitor_config,
            local_peer_id=run.identity.peer_id,
            on_quit=stop.set,
        )

    return companion


def run_join(args: argparse.Namespace) -> int:
    config = load_config(args)  # before torch is imported: a bad option answers at once

    from dht.gc_policy import settle as settle_gc
    from peer.run.make import make_peer_run
    from peer.swarm.progress import note_continued
    from peer.train.tasks import TaskError

    stop = threading.Event()
    try:
        run = make_peer_run(config, stop_event=stop)
    except TaskError as e:
        sys.stderr.write(f"peer: error: {e}\n")
        return 2
    if config.dashboard:
        run.companion = dashboard_companion(config, stop)
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # continued after Ctrl-Z or SIGSTOP: the stop was not slow training (see note_continued)
    signal.signal(signal.SIGCONT, lambda *_: note_continued())
    if config.backend == "native":  # the hivemind backend keeps hivemind's process as it is
        settle_gc()  # imports and the model are in: the collector's policy for a long run
    try:
        summary = run.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    line = (
        f"peer {summary.peer_id[:8]}: epoch {summary.epoch}, {summary.num_steps} steps, "
        f"{summary.samples_per_s:.0f} samples/s, {summary.num_rounds} rounds "
        f"({summary.num_failed_rounds} failed), loss {summary.final_loss}, "
        f"stopped by {summary.stopped_by}"
    )
    print(line, flush=True)
    if args.json:
        print(json.dumps(dataclasses.asdict(summary)), flush=True)
    return 0
