"""The report's PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from experiments.analysis import ConfigResult
from peer.records.profile import PROFILE_PHASES

DPI = 110


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def _loss_plot(results: list[ConfigResult], x: str, target: float | None, path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(8, 5))
    for result in results:
        if not result.curve:
            continue
        xs = [p.t_s if x == "time" else p.samples for p in result.curve]
        style = {"color": "black", "linewidth": 2.2} if result.baseline else {"linewidth": 1.2}
        axes.plot(xs, [p.loss for p in result.curve], label=result.name, **style)
    if target is not None:
        axes.axhline(target, color="grey", linestyle="--", linewidth=1, label="target loss")
    axes.set_xlabel("wall time (s)" if x == "time" else "samples processed (all peers)")
    axes.set_ylabel("training loss (swarm mean)")
    axes.set_title(f"Loss vs {'wall time' if x == 'time' else 'samples'}")
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return _save(figure, path)


def _efficiency_plot(results: list[ConfigResult], target: float | None, path: Path) -> Path:
    """Loss against samples (statistical efficiency) beside loss against time, same legend."""
    figure, (by_samples, by_time) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for result in results:
        style = {"color": "black", "linewidth": 2.2} if result.baseline else {"linewidth": 1.2}
        losses = [p.loss for p in result.curve]
        by_samples.plot([p.samples for p in result.curve], losses, label=result.name, **style)
        by_time.plot([p.t_s for p in result.curve], losses, label=result.name, **style)
    for axes, label in ((by_samples, "samples processed (all peers)"), (by_time, "wall time (s)")):
        if target is not None:
            axes.axhline(target, color="grey", linestyle="--", linewidth=1)
        axes.set_xlabel(label)
        axes.grid(alpha=0.3)
    by_samples.set_ylabel("training loss (swarm mean)")
    by_samples.set_title("Statistical efficiency: loss vs samples")
    by_time.set_title("Loss vs wall time")
    by_time.legend(fontsize="x-small")
    return _save(figure, path)


def _bar_plot(names: list[str], values: list[float], ylabel: str, title: str, path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(max(6, 0.6 * len(names) + 3), 4.5))
    axes.bar(range(len(names)), values, color="tab:blue")
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(axis="y", alpha=0.3)
    return _save(figure, path)


def _phase_plot(results: list[ConfigResult], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(max(6, 0.6 * len(results) + 4), 5))
    bottoms = [0.0] * len(results)
    colors = plt.get_cmap("tab10")
    for number, phase in enumerate(PROFILE_PHASES):
        shares = [100 * r.swarm.fractions()[phase] for r in results]
        axes.bar(range(len(results)), shares, bottom=bottoms, label=phase, color=colors(number))
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    axes.set_xticks(
        range(len(results)), [r.name for r in results], rotation=30, ha="right", fontsize="small"
    )
    axes.set_ylabel("% of wall time (all peers)")
    axes.set_title("Where the time goes")
    axes.legend(fontsize="small", bbox_to_anchor=(1.01, 1), loc="upper left")
    return _save(figure, path)


def write_plots(
    plot_dir: Path, results: list[ConfigResult], rows: list[dict], target: float | None
) -> list[Path]:
    """Write every plot that has data; returns their paths."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    with_data = [r for r in results if r.curve]
    if not with_data:
        return []
    paths = [
        _loss_plot(with_data, "time", target, plot_dir / "loss_vs_time.png"),
        _loss_plot(with_data, "samples", target, plot_dir / "loss_vs_samples.png"),
        _efficiency_plot(with_data, target, plot_dir / "loss_vs_samples_and_time.png"),
        _bar_plot(
            [r["config"] for r in rows],
            [float(r["samples_per_s"] or 0.0) for r in rows],
            "samples/s (all peers)",
            "Throughput",
            plot_dir / "throughput.png",
        ),
        _phase_plot(with_data, plot_dir / "phases.png"),
    ]
    reached = [r for r in rows if r["time_to_target_s"] is not None]
    if reached:
        labels = [
            r["config"] + (f" (x{r['speedup']:.2f})" if r["speedup"] is not None else "")
            for r in reached
        ]
        paths.append(
            _bar_plot(
                labels,
                [r["time_to_target_s"] for r in reached],
                "seconds to target loss",
                "Time to target loss (speedup over the baseline)",
                plot_dir / "time_to_target.png",
            )
        )
    swarm_rows = [r for r in rows if r["sent_bytes_per_peer_round"] is not None]
    if swarm_rows:
        paths.append(
            _bar_plot(
                [r["config"] for r in swarm_rows],
                [r["sent_bytes_per_peer_round"] / 2**20 for r in swarm_rows],
                "MiB sent per peer per round",
                "Bytes per round",
                plot_dir / "bytes_per_round.png",
            )
        )
    return paths
