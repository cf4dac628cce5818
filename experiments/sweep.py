"""``peer experiment run``: every configuration of a spec, one after the other, into DIR.

``DIR/spec.toml`` is a copy of the spec; ``DIR/<config>/`` holds ``config.json`` (its
settings), every process's metrics stream (``*.jsonl``), stdout (``*.out``) and log (``*.log``),
and ``status.json``. A failed configuration is marked failed and the sweep goes on; a finished
one is skipped by the next run unless ``force``. SIGTERM is handled like Ctrl-C: the current
configuration's processes are stopped and the launcher cleans up before the exit.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from experiments.launch_base import Launcher, LaunchError
from experiments.runner import Outcome, is_finished, run_config, write_status
from experiments.spec import ExperimentSpec, RunConfig, expand


def make_launcher(spec: ExperimentSpec) -> Launcher:
    """The launcher the spec names."""
    if spec.launcher == "netns":
        from experiments.launch_netns import NetnsLauncher

        return NetnsLauncher(spec.network)
    if spec.launcher == "ssh":
        from experiments.launch_ssh import SshLauncher

        return SshLauncher(spec.ssh)
    from experiments.launch_local import LocalLauncher

    return LocalLauncher()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, so cleanup runs as on Ctrl-C."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=not console.is_terminal,
    )


def run_sweep(
    spec: ExperimentSpec,
    spec_text: str,
    out_dir: Path,
    *,
    force: bool = False,
    console: Console | None = None,
) -> dict[str, Outcome | None]:
    """Run the sweep; returns config name -> outcome (None: skipped as already finished).

    Raises:
        experiments.launch_base.LaunchError: the launcher cannot run here (nothing started).
    """
    console = console or Console(stderr=True)
    configs = expand(spec)
    launcher = make_launcher(spec)
    launcher.check()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.toml").write_text(spec_text, encoding="utf-8")
    outcomes: dict[str, Outcome | None] = {}
    with sigterm_as_interrupt(), launcher, _progress(console) as progress:
        bar = progress.add_task(spec.name, total=len(configs), status="")
        for config in configs:
            progress.update(bar, description=f"{spec.name}: {config.name}", status="")

            def on_update(text: str) -> None:
                progress.update(bar, status=text)

            on_update_or_none = on_update if console.is_terminal else None
            outcomes[config.name] = _one(
                spec, config, out_dir, launcher, force, console, on_update_or_none
            )
            progress.advance(bar)
    return outcomes


def _one(
    spec: ExperimentSpec,
    config: RunConfig,
    out_dir: Path,
    launcher: Launcher,
    force: bool,
    console: Console,
    on_update: Callable[[str], None] | None,
) -> Outcome | None:
    config_dir = out_dir / config.name
    if not force and is_finished(config_dir, config):
        console.print(f"{config.name}: finished before, skipped (--force reruns it)")
        return None
    if config_dir.exists():
        shutil.rmtree(config_dir)
    config_dir.mkdir(parents=True)
    (config_dir / "config.json").write_text(json.dumps(config.describe(), indent=2) + "\n")
    num_peers = 0 if config.baseline else config.train.peers
    try:
        with launcher.open_session(config_dir, num_peers) as session:
            outcome = run_config(spec, config, session, on_update)
    except LaunchError as e:  # the session could not be set up: this configuration fails
        outcome = Outcome(status="failed", reason=str(e))
    write_status(config_dir, outcome)
    if outcome.status == "done":
        text = f"{config.name}: done in {outcome.seconds:.0f} s ({outcome.stopped_by})"
        console.print(text, highlight=False)
    else:
        console.print(f"[red]{config.name}: failed[/red]: {outcome.reason}")
    sys.stderr.flush()
    return outcome
