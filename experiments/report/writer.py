"""``peer experiment report DIR``: ``report.md``, PNG plots and CSV tables from a sweep.

Reads only ``DIR/spec.toml`` (for the target loss) and each ``DIR/<config>/`` (its metrics
streams, ``config.json`` and ``status.json``). Per configuration: wall time, samples, swarm
samples/s, final loss, rounds, time to the target loss and the speedup over the baseline of the
same seed (its time to target over the configuration's), throughput over the baseline's, bytes
one peer sent per round, the measured RTT (median of the peers' ``net.rtt_ms``) and the rate a
peer sent at (Mbit/s), the phase shares and the bottleneck verdict.
"""

from __future__ import annotations

import csv
from pathlib import Path

from experiments.analysis import PLACEMENT_FILE, ConfigResult, load_result, read_json
from experiments.spec import SpecError, load_spec
from peer.records.profile import PROFILE_PHASES

SUMMARY_COLUMNS = (
    "config", "status", "peers", "seed", "wall_s", "samples", "samples_per_s", "final_loss",
    "rounds", "time_to_target_s", "speedup", "throughput_ratio", "sent_bytes_per_peer_round",
    "rtt_ms", "sent_mbit_per_s", "bottleneck",
)  # fmt: skip


def load_results(out_dir: Path, target_loss: float | None) -> list[ConfigResult]:
    """Every configuration directory's result, baselines first."""
    dirs = sorted(p.parent for p in out_dir.glob("*/config.json"))
    results = [load_result(d, target_loss) for d in dirs]
    return sorted(results, key=lambda r: (not r.baseline, r.name))


def _baseline_for(result: ConfigResult, results: list[ConfigResult]) -> ConfigResult | None:
    baselines = [r for r in results if r.baseline and r.curve]
    same_seed = [r for r in baselines if r.seed == result.seed]
    return (same_seed or baselines or [None])[0]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def summary_row(result: ConfigResult, results: list[ConfigResult]) -> dict[str, object]:
    """One configuration's numbers (raw, unrounded), keyed by :data:`SUMMARY_COLUMNS`."""
    base = None if result.baseline else _baseline_for(result, results)
    swarm = result.swarm
    return {
        "config": result.name,
        "status": result.status,
        "peers": result.num_peers,
        "seed": result.seed,
        "wall_s": swarm.wall_s,
        "samples": swarm.samples,
        "samples_per_s": swarm.samples_per_s,
        "final_loss": result.final_loss,
        "rounds": result.rounds,
        "time_to_target_s": result.time_to_target_s,
        "speedup": _ratio(base and base.time_to_target_s, result.time_to_target_s),
        "throughput_ratio": _ratio(swarm.samples_per_s, base and base.swarm.samples_per_s),
        "sent_bytes_per_peer_round": result.sent_bytes_per_round,
        "rtt_ms": result.rtt_ms,
        "sent_mbit_per_s": None if result.baseline else result.sent_mbit_per_s,
        "bottleneck": swarm.verdict().bottleneck if swarm.wall_s > 0 else "",
    }


def _cell(value: object, digits: int = 1) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


DIGITS = {"final_loss": 4, "speedup": 2, "throughput_ratio": 2, "sent_bytes_per_peer_round": 0}
DIGITS |= {"rtt_ms": 1, "sent_mbit_per_s": 2}


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _write_csv(path: Path, header: list[str], rows: list[list[object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(["" if v is None else v for v in row] for row in rows)


def _target_loss(out_dir: Path, override: float | None) -> tuple[float | None, str]:
    spec = load_spec(out_dir / "spec.toml")
    target = override if override is not None else spec.stop.target_loss
    return target, f"{spec.name} (launcher {spec.launcher}, task {spec.task.name})"


def study_sections(
    out_dir: Path, results: list[ConfigResult], rows: list[dict[str, object]], target: float | None
) -> list[str]:
    """The baseline's setting, fairness, the seed-pooled table and the findings
    (:mod:`experiments.report.study`)."""
    from experiments.report import fairness, study

    spec = load_spec(out_dir / "spec.toml")
    groups = study.make_groups(results, rows)
    factors = [key for key, values in spec.grid.items() if len(values) > 1]
    return [
        *fairness.baseline_lines(out_dir, results),
        *fairness.suspect_lines(
            groups, spec.resources.total_cpus, calibrated=spec.calibration.enabled
        ),
        *study.study_lines(groups, target, spec.resources.total_cpus),
        *study.decomposition_lines(groups, target),
        *study.findings_lines(groups, factors),
    ]


def placement_lines(out_dir: Path, results: list[ConfigResult]) -> list[str]:
    """Where each process ran (node id and address), for launchers that place processes on a
    cluster (``placement.json``: the ray launcher); nothing for the others."""
    rows = []
    for result in results:
        placed = read_json(out_dir / result.name / PLACEMENT_FILE)
        for process in placed if isinstance(placed, list) else []:
            cpus = process.get("cpus")
            rows.append(
                [
                    result.name,
                    str(process.get("name", "?")),
                    str(process.get("node_id", "?")),
                    str(process.get("address", "?")),
                    str(process.get("hostname", "?")),
                    "-" if cpus is None else ",".join(map(str, cpus)),
                ]
            )
    if not rows:
        return []
    header = ["config", "process", "node_id", "address", "hostname", "pinned_cpus"]
    return ["", "## Where each process ran", "", *_markdown_table(header, rows)]


def write_report(out_dir: Path, *, target_loss: float | None = None) -> Path:
    """Write ``report.md``, ``plots/*.png`` and ``tables/*.csv`` into ``out_dir``.

    Raises:
        SpecError: ``out_dir/spec.toml`` is missing or invalid.
    """
    if not (out_dir / "spec.toml").is_file():
        raise SpecError(f"{out_dir}/spec.toml: missing (not a sweep directory)")
    target, title = _target_loss(out_dir, target_loss)
    results = load_results(out_dir, target)
    rows = [summary_row(r, results) for r in results]
    _write_csv(
        out_dir / "tables" / "summary.csv",
        list(SUMMARY_COLUMNS),
        [[row[c] for c in SUMMARY_COLUMNS] for row in rows],
    )
    phase_rows = [[r.name, *(r.swarm.fractions()[p] for p in PROFILE_PHASES)] for r in results]
    _write_csv(out_dir / "tables" / "phases.csv", ["config", *PROFILE_PHASES], phase_rows)
    _write_csv(
        out_dir / "tables" / "curves.csv",
        ["config", "t_s", "samples", "loss"],
        [[r.name, p.t_s, p.samples, p.loss] for r in results for p in r.curve],
    )
    from experiments.report.plots import write_plots

    plots = write_plots(out_dir / "plots", results, rows, target)
    lines = [f"# Experiment report: {title}", ""]
    lines += [
        f"Target loss: {_cell(target, 4)}. Loss is the swarm's: the mean over peers of each "
        "peer's last 3 metrics lines. Speedup = the baseline's time to the target loss / the "
        "configuration's (same seed); throughput ratio = samples/s over the baseline's; rtt_ms = "
        "median RTT the peers measured; sent_mbit_per_s = a peer's send rate over its wall time.",
        "",
        "## Summary",
        "",
    ]
    lines += _markdown_table(
        list(SUMMARY_COLUMNS),
        [[_cell(row[c], DIGITS.get(c, 1)) for c in SUMMARY_COLUMNS] for row in rows],
    )
    lines += ["", *study_sections(out_dir, results, rows, target)]
    lines += ["## Where the time goes (% of wall time per phase, all peers)", ""]
    lines += _markdown_table(
        ["config", *PROFILE_PHASES, "verdict"],
        [
            [
                r.name,
                *(f"{100 * r.swarm.fractions()[p]:.1f}" for p in PROFILE_PHASES),
                r.swarm.verdict().text if r.swarm.wall_s > 0 else "-",
            ]
            for r in results
        ],
    )
    lines += placement_lines(out_dir, results)
    failed = [r for r in results if r.status != "done"]
    if failed:
        lines += ["", "## Failed or unfinished configurations", ""]
        lines += [f"- `{r.name}` ({r.status}): {r.reason or 'no status'}" for r in failed]
    bad = [r for r in results if r.num_bad_lines]
    lines += [f"- `{r.name}`: {r.num_bad_lines} invalid metrics lines skipped" for r in bad]
    lines += ["", "## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots]
    lines += ["", "Tables as CSV: `tables/summary.csv`, `tables/phases.csv`, `tables/curves.csv`."]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report
