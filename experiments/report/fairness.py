"""Fairness of the comparison: the baseline's setting, its drift, and suspect speedups.

* Which setting the baseline ran with (from the calibration, :mod:`experiments.calibration`),
  the calibration's trials, and a warning when the baseline ran far below its calibrated rate.
* Every configuration whose throughput per CPU beats the baseline's by more than
  :data:`SUSPECT_RATIO` is flagged ``baseline suspect``: N processes on the same CPUs cannot do
  more work per CPU than one unless that one was held back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from experiments.analysis import ConfigResult
from experiments.report.study import Group, Spread, per_cpu, read, table

# Throughput per CPU above the baseline's by more than this factor: the baseline is suspect.
SUSPECT_RATIO = 1.2


def baseline_lines(out_dir: Path, results: list[ConfigResult]) -> list[str]:
    """The baseline's setting (calibrated or not) and the calibration's trials."""
    from experiments.calibration import CALIBRATION_FILE, Calibration, settings_table

    lines = ["## The baseline", ""]
    tunings = [read(out_dir / r.name / "config.json").get("tuning") for r in results if r.baseline]
    tuning = next((t for t in tunings if t), None)
    if tuning is None:
        lines += [
            "The baseline was **not calibrated** (`[calibration] enabled = false`): it ran "
            "with one torch thread per CPU and the spec's environment, which may be slower "
            "than its peers' setting. Treat speedups with care.",
            "",
        ]
        return lines
    (cpus, chosen), *_ = tuning["per_cpus"].items()
    threads = chosen["torch_threads"]
    lines += [
        f"Tuned baseline: **{threads} torch thread{'s' * (threads > 1)}, "
        f"OMP_WAIT_POLICY={chosen['wait_policy']}, {tuning['num_workers']} loader workers on "
        f"{cpus} CPUs**, the calibration's choice ({chosen['samples_per_s']:.1f} samples/s: the "
        "fastest setting, or one within 10% of it that is less fragile under load).",
        "",
    ]
    lines += _drift_lines(results, chosen["samples_per_s"])
    path = out_dir / CALIBRATION_FILE
    if path.is_file():
        calibration = Calibration.from_json(json.loads(path.read_text(encoding="utf-8")))
        header = ["role", "CPUs", "threads", "OMP_WAIT_POLICY", "workers", "samples/s", ""]
        load = calibration.load_average
        during = (
            f" The machine's 1-minute load average was {load[0]:.1f} before and {load[-1]:.1f} "
            f"after it, on {os.cpu_count()} CPUs: a load above the CPU count makes every rate "
            "here (and in the sweep) noisy."
            if load
            else ""
        )
        lines += [
            "Calibration (each setting trained alone, pinned as in the sweep; samples/s is the "
            f"median of the repeats, each repeat in brackets).{during}",
            "",
        ]
        lines += [*table(header, settings_table(calibration)), ""]
    return lines


_UNCALIBRATED = (
    "The same CPUs do not do more work split into processes unless the baseline was held "
    "back: rerun with `[calibration] enabled = true`, or check its setting."
)
_CALIBRATED = (
    "The baseline ran in its fastest calibrated setting, so either the machine's load changed "
    "between runs (compare the calibration's rates) or the model is too small for one process "
    "to use the CPUs (threads scale worse than processes): then the speedup measures that, not "
    "collaborative training."
)


# The baseline's rate in the sweep below this share of its calibrated rate: something changed.
DRIFT_FRACTION = 0.5


def _drift_lines(results: list[ConfigResult], calibrated_per_s: float) -> list[str]:
    """A warning when the baseline ran far slower in the sweep than when it was calibrated."""
    rates = [r.swarm.samples_per_s for r in results if r.baseline and r.swarm.wall_s > 0]
    if not rates or min(rates) >= DRIFT_FRACTION * calibrated_per_s:
        return []
    return [
        f"**Warning: the baseline ran at {min(rates):.1f}-{max(rates):.1f} samples/s in the "
        f"sweep, under {DRIFT_FRACTION:.0%} of the {calibrated_per_s:.1f} it was calibrated at.** "
        "The machine's load changed, or the setting is fragile under load (spinning OpenMP "
        "threads, more threads than free cores); every comparison with it below is unfair. "
        'Rerun on a quiet machine, with `repeats = 2`, or with `wait_policies = ["PASSIVE"]`.',
        "",
    ]


def suspect_lines(groups: list[Group], total_cpus: int, *, calibrated: bool) -> list[str]:
    """Configurations whose throughput per CPU beats the baseline's by > SUSPECT_RATIO."""
    baseline = next((g for g in groups if g.baseline), None)
    if baseline is None:
        return []
    base = Spread.of(per_cpu(row, total_cpus) for row in baseline.rows)
    if base is None:
        return []
    flagged = []
    for group in groups:
        mine = Spread.of(per_cpu(row, total_cpus) for row in group.rows)
        if group.baseline or mine is None or mine.mean <= SUSPECT_RATIO * base.mean:
            continue
        flagged.append(
            f"- **baseline suspect**: `{group.key}` trained {mine.text()} samples/s per CPU, the "
            f"baseline {base.text()} ({mine.mean / base.mean:.2f}x > {SUSPECT_RATIO:.2f}x). "
            + (_CALIBRATED if calibrated else _UNCALIBRATED)
        )
    lines = ["## Fairness", ""]
    if not flagged:
        return [
            *lines,
            f"No configuration beats the baseline's throughput per CPU ({base.text()} "
            f"samples/s per CPU) by more than {SUSPECT_RATIO:.2f}x.",
            "",
        ]
    return [*lines, *flagged, ""]
