"""Running a configuration: its process plans, watching them, the stopping rules, its status.

A swarm configuration is a bootstrap node plus N ``peer join`` processes that wait for each
other before their clocks start (``--wait-for-peers N``) and stop on ``--max-time`` /
``--max-epochs``; a baseline configuration is one ``python -m peer.bench.baseline_run`` with all the
CPUs. The target-loss rule is watched here from the metrics files (SIGTERM: peers end their step
and write a last line). ``status.json`` records the outcome; a configuration whose status is
``done`` and whose settings are unchanged is skipped by the next sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from experiments.analysis import STATUS_FILE, CurvePoint, loss_curve, read_json
from experiments.launch.base import LaunchError, ProcessPlan, Session
from experiments.spec import ExperimentSpec, RunConfig, cpu_split
from peer.profiling.metrics_reader import read_metrics
from peer.run.flags import join_command

WATCH_INTERVAL_S = 0.5
# (bootstrap URL, session) -> a context manager showing the swarm while it is open.
Dashboard = Callable[[str, Session], contextlib.AbstractContextManager[object]]
# How often the target-loss rule reads the metrics files (remote sessions copy them first).
LOSS_CHECK_INTERVAL_S = 2.0


@dataclasses.dataclass
class Outcome:
    """How a configuration ended."""

    status: str  # done, failed
    reason: str = ""
    stopped_by: str = ""
    exit_codes: dict[str, int | None] = dataclasses.field(default_factory=dict)
    started_at: str = ""
    seconds: float = 0.0
    # the machine's 1-minute load average when it started and ended (a shared machine's noise)
    load_average: list[float] = dataclasses.field(default_factory=list)


def run_id(spec: ExperimentSpec, config: RunConfig) -> str:
    """The DHT run id of a configuration's peers (and the baseline's metrics)."""
    return f"{spec.name}-{config.name}"


def _task_args(spec: ExperimentSpec, config: RunConfig) -> list[str]:
    args = ["--task", spec.task.name]
    options = dict(spec.task.options)
    if config.train.batch_size is not None:
        options["batch_size"] = config.train.batch_size
    for key, value in options.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--task-option", f"{key}={text}"]
    return args


def _stop_args(spec: ExperimentSpec) -> list[str]:
    args = []
    if spec.stop.max_time_s is not None:
        args += ["--max-time", str(spec.stop.max_time_s)]
    if spec.stop.max_epochs is not None:
        args += ["--max-epochs", str(spec.stop.max_epochs)]
    return args


def _gpu_env(spec: ExperimentSpec, index: int) -> tuple[dict[str, str], list[str]]:
    gpus, env = spec.resources.gpus, dict(spec.resources.env)
    if not gpus:
        return env, []
    env["CUDA_VISIBLE_DEVICES"] = str(gpus[index % len(gpus)])
    return env, ["--device", "cuda"]


def tuned_threads(config: RunConfig, num_cpus: int, env: dict[str, str]) -> int:
    """The calibrated torch threads for a process on ``num_cpus`` CPUs (its OpenMP wait policy
    goes into ``env``); without calibration, one thread per CPU and the spec's environment."""
    tuning = (config.tuning or {}).get("per_cpus", {}).get(str(num_cpus))
    if tuning is None:
        return num_cpus
    env["OMP_WAIT_POLICY"] = tuning["wait_policy"]
    return int(tuning["torch_threads"])


def peer_plans(spec: ExperimentSpec, config: RunConfig) -> list[ProcessPlan]:
    """The ``peer join`` processes of a swarm configuration."""
    train, num_peers = config.train, config.train.peers
    blocks = cpu_split(spec.resources.total_cpus, num_peers)
    plans = []
    for index, cpus in enumerate(blocks):
        env, device_args = _gpu_env(spec, index)
        args = join_command(
            log_level="INFO",
            run_id=run_id(spec, config),
            backend=train.backend,
            target_batch_size=train.target_batch_size,
            lr=train.lr,
            optimizer=train.optimizer,
            mode=train.mode,
            compression=train.compression,
            seed=config.seed * 1000 + index,
            torch_threads=tuned_threads(config, len(cpus), env),
            num_workers=train.num_workers,
            wait_for_peers=num_peers,
            metrics_interval=spec.metrics_interval_s,
            delay_update=True if train.delay_update else None,
            matchmaking_time=train.matchmaking_time_s,
        )
        args += [*_task_args(spec, config), *_stop_args(spec), *device_args]
        args += train.join_args
        plans.append(
            ProcessPlan(
                name=f"peer-{index}",
                args=args,
                index=index,
                cpus=cpus if spec.resources.pin_cpus else None,
                env=env,
            )
        )
    return plans


def bootstrap_plan(config: RunConfig) -> ProcessPlan:
    """The bootstrap node: ``peer dht``, or a hivemind node for the hivemind backend."""
    if config.train.backend == "hivemind":
        args = ["-m", "experiments.hivemind_dht"]
    else:
        args = ["-m", "peer", "--log-level", "WARNING", "dht"]
    return ProcessPlan(name="dht", args=args, metrics=False)


def baseline_plan(spec: ExperimentSpec, config: RunConfig) -> ProcessPlan:
    """The single-node baseline: every CPU, in its calibrated setting (without calibration:
    torch threads = total CPUs, no loader workers)."""
    train, total = config.train, spec.resources.total_cpus
    env, device_args = _gpu_env(spec, 0)
    threads = tuned_threads(config, total, env)
    workers = int((config.tuning or {}).get("num_workers", 0))
    args = [
        "-m", "peer.bench.baseline_run",
        "--run-id", run_id(spec, config),
        "--target-batch-size", str(train.target_batch_size),
        "--lr", str(train.lr),
        "--optimizer", train.optimizer,
        "--seed", str(config.seed * 1000),
        "--torch-threads", str(threads),
        "--metrics-interval", str(spec.metrics_interval_s),
        *_task_args(spec, config), *_stop_args(spec), *device_args,
    ]  # fmt: skip
    if workers:
        args += ["--num-workers", str(workers)]
    cpus = list(range(total)) if spec.resources.pin_cpus else None
    return ProcessPlan(name="baseline", args=args, cpus=cpus, env=env, listens=False)


def _latest(session: Session, names: list[str]) -> CurvePoint | None:
    for name in names:
        session.refresh(name)
    paths = [session.run_dir / f"{name}.jsonl" for name in names]
    curve = loss_curve(read_metrics([p for p in paths if p.exists()]).peers)
    return curve[-1] if curve else None


def watch(
    spec: ExperimentSpec,
    session: Session,
    plans: list[ProcessPlan],
    on_update: Callable[[str], None] | None = None,
) -> Outcome:
    """Wait until the processes end or a stopping rule fires; stops them in the latter case.

    ``on_update`` (when given) gets a one-line status of the run every few seconds.
    """
    handles = [h for h in session.handles if h.name in {p.name for p in plans}]
    start = time.monotonic()
    next_check_s = start + LOSS_CHECK_INTERVAL_S
    outcome = Outcome(status="done", stopped_by="max_time_s or max_epochs")
    while any(h.poll() is None for h in handles):
        now = time.monotonic()
        if now - start > spec.stop.timeout_s:
            outcome.stopped_by = "timeout_s"
            session.stop_all()
            break
        if (spec.stop.target_loss is not None or on_update) and now >= next_check_s:
            next_check_s = now + LOSS_CHECK_INTERVAL_S
            point = _latest(session, [p.name for p in plans])
            loss = None if point is None else point.loss
            if on_update is not None:
                running = sum(h.poll() is None for h in handles)
                text = "starting" if point is None else f"loss {loss:.4f}, {point.samples} samples"
                on_update(f"{running} running, {now - start:.0f} s, {text}")
            target = spec.stop.target_loss
            if loss is not None and target is not None and loss <= target:
                outcome.stopped_by = "target_loss"
                for handle in handles:
                    handle.terminate()
        time.sleep(WATCH_INTERVAL_S)
    outcome.exit_codes = {h.name: h.poll() for h in handles}
    failed = {name: code for name, code in outcome.exit_codes.items() if code != 0}
    if outcome.stopped_by == "target_loss":
        # Asked to stop by our SIGTERM and ended by it (the baseline with loader workers can die
        # of it in interpreter teardown, after its last metrics line): stopped, not failed.
        failed = {name: code for name, code in failed.items() if code != -signal.SIGTERM}
    if outcome.stopped_by == "timeout_s":
        outcome.status, outcome.reason = "failed", f"still running after {spec.stop.timeout_s} s"
    elif failed:
        name, code = next(iter(failed.items()))
        plan = next(p for p in plans if p.name == name)
        outcome.status = "failed"
        outcome.reason = f"{name} exited with {code}: {session.tail(plan)}"
    return outcome


def run_config(
    spec: ExperimentSpec,
    config: RunConfig,
    session: Session,
    on_update: Callable[[str], None] | None = None,
    dashboard: Dashboard | None = None,
) -> Outcome:
    """Run one configuration in ``session``; never raises for the configuration's own failure.

    ``on_update``: see :func:`watch`. ``dashboard``: shows a swarm configuration (given the
    bootstrap's URL); opened before the peers start (joining the swarm takes none of their time
    nor delays the stopping rules) and closed before they are stopped, also on Ctrl-C.
    """
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    try:
        view: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if config.baseline:
            plans = [baseline_plan(spec, config)]
        else:
            url = session.start_bootstrap(bootstrap_plan(config))
            plans = peer_plans(spec, config)
            plans = [dataclasses.replace(p, args=[*p.args, "--initial-peers", url]) for p in plans]
            if dashboard is not None:
                view = dashboard(url, session)
        with view:
            for plan in plans:
                session.start(plan)
            outcome = watch(spec, session, plans, on_update)
    except LaunchError as e:
        outcome = Outcome(status="failed", reason=str(e))
    finally:
        session.stop_all()
        session.collect()
    outcome.started_at = started_at
    outcome.seconds = round(time.monotonic() - start, 2)
    outcome.load_average = [load_before, os.getloadavg()[0]]
    if outcome.status == "done" and not any(session.run_dir.glob("*.jsonl")):
        outcome.status, outcome.reason = "failed", "no metrics stream was written"
    return outcome


def is_finished(config_dir: Path, config: RunConfig) -> bool:
    """Whether a previous sweep finished this configuration with the same settings."""
    status = read_json(config_dir / STATUS_FILE)
    return status.get("status") == "done" and read_json(config_dir / "config.json") == json.loads(
        json.dumps(config.describe())
    )


def write_status(config_dir: Path, outcome: Outcome) -> None:
    (config_dir / STATUS_FILE).write_text(json.dumps(dataclasses.asdict(outcome), indent=2) + "\n")
