"""Running real peers the way ``peer experiment run`` does, and reading their verdicts."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from experiments.launch.base import Session
from experiments.launch.local import LocalLauncher
from experiments.runner import bootstrap_plan, peer_plans, run_config
from experiments.spec import ExperimentSpec, RunConfig, expand, parse_spec
from peer.profiling.metrics_reader import read_metrics, summarize_lines
from peer.profiling.summary import StretchSummary


def netns_unavailable() -> str | None:
    """Why the netns launcher cannot run here (None: it can)."""
    from experiments.launch.netns import delete_namespace

    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} missing (install iproute2)"
    # one name per process: pytest-xdist workers collect (and so probe) at the same time
    probe = f"vpx-verdict-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    delete_namespace(probe)
    return None if done.returncode == 0 else f"no network namespaces: {done.stderr.strip()}"


def make_spec(
    *,
    task: str,
    options: dict[str, Any],
    train: dict[str, Any],
    stop_s: float,
    launcher: str = "local",
    network: dict[str, Any] | None = None,
) -> ExperimentSpec:
    """A one-configuration spec: no baseline, 2 CPUs pinned, passive OpenMP threads."""
    data: dict[str, Any] = {
        "name": "verdict",
        "launcher": launcher,
        "baseline": False,
        "metrics_interval_s": 1.0,
        "task": {"name": task, "options": options},
        "train": train,
        "resources": {"total_cpus": 2, "pin_cpus": True, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
        "stop": {"max_time_s": stop_s, "timeout_s": 150},
    }
    if network is not None:
        data["network"] = network
    return parse_spec(data)


def summaries(
    run_dir: Path, *, warm_up_s: float = 0.0, cool_down_s: float = 0.0
) -> dict[str, StretchSummary]:
    """Each process's metrics stream (``<name>.jsonl``) added up, by file name, leaving out
    the lines that end within the first ``warm_up_s`` or start within the last ``cool_down_s``
    seconds of the peer's profiled time."""
    result = {}
    for path in sorted(run_dir.glob("peer-*.jsonl")):
        found = read_metrics([path])
        assert len(found.peers) == 1 and not found.num_bad_lines, (path, found.errors)
        lines = next(iter(found.peers.values()))
        walls_s = [sum(line.phases.values()) for line in lines]
        ends_s = list(itertools.accumulate(walls_s))
        last_start_s = (ends_s[-1] if ends_s else 0.0) - cool_down_s
        kept = [
            line
            for line, wall_s, end_s in zip(lines, walls_s, ends_s, strict=True)
            if end_s > warm_up_s and end_s - wall_s < last_start_s
        ]
        result[path.stem] = summarize_lines(kept)
    return result


def run_swarm(spec: ExperimentSpec, run_dir: Path) -> dict[str, StretchSummary]:
    """Run the spec's only configuration (local launcher) and summarize each peer."""
    config = expand(spec)[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    launcher = _launcher(spec)
    with launcher, launcher.open_session(run_dir, config.train.peers) as session:
        outcome = run_config(spec, config, session)
    assert outcome.status == "done", outcome.reason
    return summaries(run_dir)


def _launcher(spec: ExperimentSpec):
    if spec.launcher == "netns":
        from experiments.launch.netns import NetnsLauncher

        launcher = NetnsLauncher(spec.network)
        launcher.check()  # as a sweep does: picks the link emulator (netem or user space)
        return launcher
    return LocalLauncher()


def run_newcomer(
    spec: ExperimentSpec, run_dir: Path, *, join_at_epoch: int, first_max_time_s: float
) -> dict[str, StretchSummary]:
    """Peer 0 trains alone until the swarm reaches ``join_at_epoch``, then peer 1 joins (a
    newcomer that must download the state) and trains the spec's ``max_time_s``; peer 0 trains
    ``first_max_time_s`` (long enough to serve the download)."""
    config: RunConfig = expand(spec)[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    plans = [_alone(p) for p in peer_plans(spec, config)]
    args = plans[0].args
    args[args.index("--max-time") + 1] = str(first_max_time_s)
    launcher = _launcher(spec)
    with launcher, launcher.open_session(run_dir, config.train.peers) as session:
        url = session.start_bootstrap(bootstrap_plan(config))
        first = session.start(_with_peers(plans[0], url))
        _wait_for_epoch(session, run_dir / "peer-0.jsonl", join_at_epoch, first)
        second = session.start(_with_peers(plans[1], url))
        deadline = time.monotonic() + spec.stop.timeout_s
        while time.monotonic() < deadline and second.poll() is None:
            time.sleep(0.5)
        session.stop_all()
        assert second.poll() == 0, session.tail(plans[1])
    return summaries(run_dir)


def _alone(plan):
    args = list(plan.args)
    args[args.index("--wait-for-peers") + 1] = "1"
    return dataclasses.replace(plan, args=args)


def _with_peers(plan, url: str):
    return dataclasses.replace(plan, args=[*plan.args, "--initial-peers", url])


def _wait_for_epoch(session: Session, path: Path, epoch: int, handle, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert handle.poll() is None, "peer 0 ended before the newcomer joined"
        if path.exists():
            lines = read_metrics([path]).peers
            if any(line.epoch >= epoch for lines in lines.values() for line in lines):
                return
        time.sleep(0.5)
    raise AssertionError(f"peer 0 did not reach epoch {epoch} in {timeout_s} s")
