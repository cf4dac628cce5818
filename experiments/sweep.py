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
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from experiments.launch.base import Launcher, LaunchError, Session
from experiments.runner import Outcome, is_finished, run_config, run_id, write_status
from experiments.spec import ExperimentSpec, RunConfig, expand
from experiments.watching import SweepScreen, Watch, WatchTarget


def make_launcher(spec: ExperimentSpec) -> Launcher:
    """The launcher the spec names."""
    if spec.launcher == "netns":
        from experiments.launch.netns import NetnsLauncher

        return NetnsLauncher(spec.network)
    if spec.launcher == "ssh":
        from experiments.launch.ssh import SshLauncher

        return SshLauncher(spec.ssh)
    if spec.launcher == "ray":
        from experiments.launch.ray import RayLauncher

        return RayLauncher(spec.ray, spec.resources.total_cpus, baseline=spec.baseline)
    from experiments.launch.local import LocalLauncher

    return LocalLauncher()


def calibrated(
    spec: ExperimentSpec, configs: list[RunConfig], out_dir: Path, console: Console
) -> list[RunConfig]:
    """``configs`` in their fastest calibrated settings, when ``[calibration]`` is enabled and
    the processes run on this machine (see :mod:`experiments.calibration`)."""
    if not spec.calibration.enabled:
        return configs
    if spec.launcher not in ("local", "netns") or spec.resources.gpus:
        where = f"launcher {spec.launcher}, GPUs {spec.resources.gpus}"
        console.print(f"calibration: skipped ({where}): it measures this machine's CPUs")
        return configs
    from experiments.calibration import apply, calibrate

    with sigterm_as_interrupt():
        return apply(spec, configs, calibrate(spec, out_dir, console))


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


def run_sweep(
    spec: ExperimentSpec,
    spec_text: str,
    out_dir: Path,
    *,
    force: bool = False,
    console: Console | None = None,
    watch: Watch | None = None,
) -> dict[str, Outcome | None]:
    """Run the sweep; returns config name -> outcome (None: skipped as already finished).

    ``watch``: the live dashboard of each swarm configuration (see
    :mod:`experiments.watching`); None shows the progress bar only.

    Raises:
        experiments.launch.base.LaunchError: the launcher cannot run here (nothing started).
    """
    console = console or Console(stderr=True)
    configs = expand(spec)
    # closed however the sweep ends, a failed check included (the ssh launcher's control
    # directory stayed behind in /tmp after every unreachable host)
    with sigterm_as_interrupt(), make_launcher(spec) as launcher:
        launcher.check()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "spec.toml").write_text(spec_text, encoding="utf-8")
        configs = calibrated(spec, configs, out_dir, console)
        outcomes: dict[str, Outcome | None] = {}
        screen = SweepScreen(console, spec.name, len(configs), watch)
        sweep = _Sweep(spec, out_dir, launcher, force, screen, len(configs))
        with screen:
            for position, config in enumerate(configs, start=1):
                screen.begin(config.name)
                outcomes[config.name] = sweep.one(config, position)
                screen.end()
    return outcomes


class _Sweep:
    """What every configuration of a sweep shares."""

    def __init__(
        self,
        spec: ExperimentSpec,
        out_dir: Path,
        launcher: Launcher,
        force: bool,
        screen: SweepScreen,
        num_configs: int,
    ):
        self.spec, self.out_dir, self.launcher, self.force = spec, out_dir, launcher, force
        self.screen, self.console, self.num_configs = screen, screen.console, num_configs

    def one(self, config: RunConfig, position: int) -> Outcome | None:
        """Run ``config`` (the ``position``-th, from 1) unless finished before."""
        spec, console = self.spec, self.console
        config_dir = self.out_dir / config.name
        if not self.force and is_finished(config_dir, config):
            console.print(f"{config.name}: finished before, skipped (--force reruns it)")
            return None
        if config_dir.exists():
            shutil.rmtree(config_dir)
        config_dir.mkdir(parents=True)
        (config_dir / "config.json").write_text(json.dumps(config.describe(), indent=2) + "\n")
        num_peers = 0 if config.baseline else config.train.peers

        def dashboard(url: str, session: Session) -> contextlib.AbstractContextManager[object]:
            target = WatchTarget(
                run_id=run_id(spec, config),
                bootstrap_url=url,
                config_name=config.name,
                position=position,
                num_configs=self.num_configs,
                num_peers=config.train.peers,
                target_batch_size=config.train.target_batch_size,
                backend=config.train.backend,
                launcher=spec.launcher,
                enter_network=session.network_entry(),
            )
            return self.screen.dashboard(target)

        on_update = self.screen.on_update if self.screen.live else None
        try:
            with self.launcher.open_session(config_dir, num_peers) as session:
                outcome = run_config(spec, config, session, on_update, dashboard)
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
