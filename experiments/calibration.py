"""Fair baselines: before a sweep, the fastest setting of the baseline and of a peer, measured.

A baseline run with a setting slower than its peers' makes every swarm look good (on main, one
2-thread process with ``OMP_WAIT_POLICY=PASSIVE`` trained at half the rate of one 1-thread peer
on the same cores). So each process kind is tried in every setting it could run with, on the
CPUs it will have, and runs with the fastest:

* the baseline, on all ``resources.total_cpus``: torch threads 1..total_cpus x OpenMP wait
  policy x ``calibration.baseline_num_workers`` loader workers;
* a peer, on its share (each distinct block of :func:`experiments.spec.cpu_split`): threads
  1..share x wait policy, for every ``num_workers`` the sweep gives its peers.

Each setting is one process (:mod:`experiments.calibration_probe`) pinned as the real one will
be, training the spec's ``[train]`` task and batch sizes with the baseline's loop. The results
go to ``DIR/calibration.json`` with a key of everything they depend on; a later sweep into the
same directory with the same key reuses them. Calibration runs on this machine, so it applies to
the ``local`` and ``netns`` launchers only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from experiments.launch.base import pinned, python
from experiments.spec import ExperimentSpec, RunConfig, cpu_split, peer_counts

CALIBRATION_FILE = "calibration.json"
# Settings this close to the fastest (a share of its rate) are a tie: the least fragile wins.
TIE_FRACTION = 0.1
# Import time of the probe process on top of the trained seconds, for its timeout.
PROBE_OVERHEAD_S = 60.0


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one process runs: on ``cpus`` CPUs, its torch threads, wait policy and workers."""

    cpus: int
    torch_threads: int
    wait_policy: str
    num_workers: int

    def text(self) -> str:
        return (
            f"{self.torch_threads} torch thread{'s' * (self.torch_threads > 1)}, "
            f"OMP_WAIT_POLICY={self.wait_policy}, {self.num_workers} loader workers "
            f"on {self.cpus} CPU{'s' * (self.cpus > 1)}"
        )


@dataclasses.dataclass(frozen=True)
class Trial:
    """One setting's measured throughput (None: it failed; ``error`` says why)."""

    role: str  # "baseline" or "peer"
    setting: Setting
    samples_per_s: float | None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Every trial, and the fastest per role and CPU count (and peer loader workers)."""

    key: str
    trials: list[Trial]
    load_average: list[float] = dataclasses.field(default_factory=list)

    def best(self, role: str, cpus: int, num_workers: int | None = None) -> Trial | None:
        """The fastest setting of ``role`` on ``cpus`` (with ``num_workers``), by the median of
        its repeats; its trial carries that median."""
        medians = [
            trial
            for trial in self.medians()
            if trial.role == role
            and trial.setting.cpus == cpus
            and trial.samples_per_s is not None
            and (num_workers is None or trial.setting.num_workers == num_workers)
        ]
        if not medians:
            return None
        # Within TIE_FRACTION of the fastest, the least fragile setting wins: spinning OpenMP
        # threads (ACTIVE), extra threads and extra workers lose most when the load rises.
        top = max(t.samples_per_s or 0.0 for t in medians)
        close = [t for t in medians if (t.samples_per_s or 0.0) >= (1 - TIE_FRACTION) * top]
        return min(close, key=_fragility)

    def medians(self) -> list[Trial]:
        """One trial per (role, setting), in first-tried order: the median of its successful
        repeats (None with the first error when none succeeded)."""
        found: dict[tuple[str, Setting], list[Trial]] = {}
        for trial in self.trials:
            found.setdefault((trial.role, trial.setting), []).append(trial)
        merged = []
        for (role, setting), trials in found.items():
            rates = [t.samples_per_s for t in trials if t.samples_per_s is not None]
            if rates:
                merged.append(Trial(role, setting, statistics.median(rates)))
            else:
                merged.append(Trial(role, setting, None, trials[0].error))
        return merged

    def to_json(self) -> dict[str, Any]:
        trials = [dataclasses.asdict(t) for t in self.trials]
        return {"key": self.key, "trials": trials, "load_average": self.load_average}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        trials = [
            Trial(t["role"], Setting(**t["setting"]), t["samples_per_s"], t.get("error", ""))
            for t in data["trials"]
        ]
        return cls(data["key"], trials, list(data.get("load_average", [])))


def _fragility(trial: Trial) -> tuple[int, int, int]:
    setting = trial.setting
    return (setting.wait_policy != "PASSIVE", setting.torch_threads, setting.num_workers)


def peer_worker_counts(spec: ExperimentSpec) -> list[int]:
    """Every ``num_workers`` the sweep's peers run with."""
    return sorted({int(v) for v in spec.grid.get("num_workers", [spec.train.num_workers])})


def peer_shares(spec: ExperimentSpec) -> list[int]:
    """Every block size a peer gets (CPUs per peer) over the sweep's peer counts."""
    total = spec.resources.total_cpus
    return sorted({len(block) for n in peer_counts(spec) for block in cpu_split(total, n)})


def settings(spec: ExperimentSpec) -> list[tuple[str, Setting]]:
    """Every ``(role, setting)`` the calibration tries, baseline first."""
    policies, total = spec.calibration.wait_policies, spec.resources.total_cpus
    tried = [
        ("baseline", Setting(total, threads, policy, workers))
        for workers in spec.calibration.baseline_num_workers
        for threads in range(1, total + 1)
        for policy in policies
    ]
    if not spec.baseline:
        tried = []
    tried += [
        ("peer", Setting(cpus, threads, policy, workers))
        for cpus in peer_shares(spec)
        for workers in peer_worker_counts(spec)
        for threads in range(1, cpus + 1)
        for policy in policies
    ]
    return tried


def calibration_key(spec: ExperimentSpec) -> str:
    """A digest of everything the measurements depend on."""
    relevant = {
        "task": spec.task.model_dump(),
        "batch_size": spec.train.batch_size,
        "target_batch_size": spec.train.target_batch_size,
        "resources": spec.resources.model_dump(),
        "calibration": spec.calibration.model_dump(),
        "settings": [(role, dataclasses.astuple(s)) for role, s in settings(spec)],
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def _probe_command(spec: ExperimentSpec, setting: Setting) -> list[str]:
    options = dict(spec.task.options)
    if spec.train.batch_size is not None:
        options["batch_size"] = spec.train.batch_size
    command = [
        python(), "-m", "experiments.calibration_probe",
        "--task", spec.task.name,
        "--target-batch-size", str(spec.train.target_batch_size),
        "--torch-threads", str(setting.torch_threads),
        "--num-workers", str(setting.num_workers),
        "--warmup-s", str(spec.calibration.warmup_s),
        "--measure-s", str(spec.calibration.measure_s),
    ]  # fmt: skip
    for key, value in options.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        command += ["--task-option", f"{key}={text}"]
    cpus = list(range(setting.cpus)) if spec.resources.pin_cpus else None
    return pinned(command, cpus)


def probe(spec: ExperimentSpec, role: str, setting: Setting) -> Trial:
    """Run one setting's probe process; a failure is a trial with an error, never a raise."""
    env = os.environ | dict(spec.resources.env) | {"OMP_WAIT_POLICY": setting.wait_policy}
    timeout_s = spec.calibration.warmup_s + spec.calibration.measure_s + PROBE_OVERHEAD_S
    try:
        done = subprocess.run(
            _probe_command(spec, setting),
            capture_output=True,
            text=True,
            env=env,
            timeout=min(timeout_s, spec.calibration.probe_timeout_s),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Trial(role, setting, None, "timed out")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-2:]) or "(no output)"
        return Trial(role, setting, None, f"exit {done.returncode}: {tail}")
    return Trial(role, setting, float(json.loads(lines[-1])["samples_per_s"]))


def calibrate(spec: ExperimentSpec, out_dir: Path, console: Console | None = None) -> Calibration:
    """Measure every setting (or reuse ``out_dir/calibration.json`` with the same key)."""
    console = console or Console(stderr=True)
    key = calibration_key(spec)
    path = out_dir / CALIBRATION_FILE
    if path.is_file():
        try:
            cached = Calibration.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            cached = None
        if cached is not None and cached.key == key:
            console.print(f"calibration: reusing {path}")
            return cached
    tried = settings(spec)
    repeats = spec.calibration.repeats
    console.print(
        f"calibration: {len(tried)} settings x {repeats}, ~{spec.calibration.measure_s:.0f} s each"
    )
    trials, load_before = [], os.getloadavg()[0]
    for repeat in range(repeats):
        # every other round in reverse: a drift in the machine's load favours no setting
        for role, setting in tried if repeat % 2 == 0 else tried[::-1]:
            start = time.monotonic()
            trial = probe(spec, role, setting)
            rate = (
                "failed: " + trial.error
                if trial.samples_per_s is None
                else (f"{trial.samples_per_s:.1f} samples/s")
            )
            took = time.monotonic() - start
            console.print(f"  {role}: {setting.text()}: {rate} ({took:.0f} s)", highlight=False)
            trials.append(trial)
    calibration = Calibration(key, trials, [load_before, os.getloadavg()[0]])
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_json(), indent=2) + "\n", encoding="utf-8")
    return calibration


def _tuning(calibration: Calibration, role: str, cpus: list[int], workers: int | None) -> dict:
    per_cpus: dict[str, dict[str, Any]] = {}
    chosen_workers = workers
    for count in sorted(set(cpus)):
        best = calibration.best(role, count, workers)
        if best is None:
            continue
        per_cpus[str(count)] = {
            "torch_threads": best.setting.torch_threads,
            "wait_policy": best.setting.wait_policy,
            "samples_per_s": best.samples_per_s,
        }
        chosen_workers = best.setting.num_workers
    return {"per_cpus": per_cpus, "num_workers": chosen_workers or 0}


def apply(spec: ExperimentSpec, configs: list[RunConfig], calibration: Calibration) -> list:
    """``configs`` with their ``tuning`` set to the fastest calibrated settings."""
    total, tuned = spec.resources.total_cpus, []
    for config in configs:
        if config.baseline:
            tuning = _tuning(calibration, "baseline", [total], None)
        else:
            blocks = cpu_split(total, config.train.peers)
            tuning = _tuning(
                calibration, "peer", [len(b) for b in blocks], config.train.num_workers
            )
        tuned.append(dataclasses.replace(config, tuning=tuning if tuning["per_cpus"] else None))
    return tuned


def settings_table(calibration: Calibration) -> list[list[str]]:
    """Rows for the report: role, CPUs, threads, wait policy, workers, samples/s (median of the
    repeats, then every repeat), chosen."""
    chosen = set()
    for trial in calibration.medians():
        workers = None if trial.role == "baseline" else trial.setting.num_workers
        best = calibration.best(trial.role, trial.setting.cpus, workers)
        if best is not None:
            chosen.add((best.role, best.setting))
    rows = []
    for trial in calibration.medians():
        s = trial.setting
        repeats = [
            "-" if t.samples_per_s is None else f"{t.samples_per_s:.1f}"
            for t in calibration.trials
            if (t.role, t.setting) == (trial.role, s)
        ]
        rate = "-" if trial.samples_per_s is None else f"{trial.samples_per_s:.1f}"
        if len(repeats) > 1:
            rate += f" ({', '.join(repeats)})"
        mark = "fastest" if (trial.role, s) in chosen else (trial.error or "")
        rows.append(
            [trial.role, str(s.cpus), str(s.torch_threads), s.wait_policy, str(s.num_workers),
             rate, mark]
        )  # fmt: skip
    return rows
