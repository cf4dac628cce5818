"""``peer bench train`` in interleaved windows: the baseline processes against the swarm's.

Both sides are processes in their own sessions, measured the same way (their metrics streams)
and paused the same way (SIGSTOP of their process groups): the plain loops are
:mod:`peer.bench.baseline_run` processes (:func:`baseline_shapes`), the swarm the N ``peer join``
processes. Neither side shares an interpreter, a GIL or an OpenMP pool with the bench, and all of
them stay in the bench's session: on a host with scheduler autogroups (one per session) both sides
draw on the same share of the CPU. See :mod:`peer.bench.train` for the design.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

from peer.bench.pairs import Interleaved, interleave
from peer.bench.processes import stop_process_group
from peer.bench.windows import MetricsFiles, PausedGroups

# Seconds between two metrics lines of each side (a window's rate runs from its first line after
# the settle to its last), seconds at the start of each window that are not measured, and
# seconds both sides train before the first window.
METRICS_INTERVAL_S = 0.1
SETTLE_S = 0.3
WARMUP_S = 1.0
# samples before a point of the swarm's run that the baseline's loss at that point averages over
LOSS_WINDOW_SAMPLES = 2048


def baseline_shapes(config) -> list[tuple[int, int]]:
    """(torch threads, data seed) of each baseline process: ``matched``, one per peer with that
    peer's threads and seed; ``single``, one with all the cores and seed 0."""
    if config.baseline == "single":
        return [(config.num_threads, 0)]
    threads = max(1, config.num_threads // config.num_peers)
    return [(threads, seed) for seed in range(config.num_peers)]


def baseline_command(
    config, metrics_file: Path, max_time_s: float, *, threads: int, seed: int
) -> list[str]:
    """A baseline process's command line (``config``: a ``TrainBenchConfig``)."""
    command = [
        sys.executable, "-m", "peer.bench.baseline_run",
        "--task", config.task,
        "--target-batch-size", str(config.target_batch_size),
        "--lr", str(config.lr),
        "--torch-threads", str(threads),
        "--seed", str(seed),
        "--max-time", str(max_time_s),
        "--metrics-file", str(metrics_file),
        "--metrics-interval", str(METRICS_INTERVAL_S),
    ]  # fmt: skip
    for option in config.all_task_options():
        command += ["--task-option", option]
    return command


async def _wait_started(metrics: MetricsFiles, processes, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not metrics.started():
            for process in processes:
                if process.returncode is not None:
                    raise RuntimeError(f"a process exited (code {process.returncode}) early")
            await asyncio.sleep(0.1)


async def run_windows(config, peers, peer_metrics: list[Path], *, start_grace_s: float) -> dict:
    """Start the baseline processes (:func:`baseline_shapes`), wait until they and every peer
    train, measure both sides in alternate windows; returns ``{"windows": Interleaved,
    "baselines": their summaries, "curve": the first one's (samples seen, loss) per metrics
    line}``. The peers are left running."""
    directory = peer_metrics[0].parent
    paths = [directory / f"baseline-{i}.jsonl" for i in range(len(baseline_shapes(config)))]
    logs = [path.with_suffix(".log") for path in paths]
    baselines = []
    try:
        for (threads, seed), path, log in zip(baseline_shapes(config), paths, logs, strict=True):
            max_time_s = 4 * config.seconds + start_grace_s
            command = baseline_command(config, path, max_time_s, threads=threads, seed=seed)
            with log.open("wb") as stderr_file:
                baselines.append(
                    await asyncio.create_subprocess_exec(
                        *command,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=stderr_file,
                        process_group=0,  # a group to pause, in the bench's session (autogroup)
                    )
                )
        windows = await _measure(config, peers, peer_metrics, baselines, paths, logs, start_grace_s)
        for baseline in baselines:
            baseline.terminate()  # it stops after its step, evaluates and prints its summary
        outputs = [
            await asyncio.wait_for(baseline.communicate(), start_grace_s) for baseline in baselines
        ]
    finally:
        await asyncio.gather(*(stop_process_group(baseline) for baseline in baselines))
    summaries = []
    for baseline, (stdout, _), log in zip(baselines, outputs, logs, strict=True):
        lines = stdout.decode().strip().splitlines()
        if baseline.returncode != 0 or not lines:
            raise RuntimeError(f"the baseline failed (exit {baseline.returncode}): {_tail(log)}")
        summaries.append(json.loads(lines[-1]))
    return {"windows": windows, "baselines": summaries, "curve": _curve(paths[0])}


async def _measure(config, peers, peer_metrics, baselines, paths, logs, start_grace_s):
    """Both sides warm, then the interleaved windows; returns the :class:`Interleaved`."""
    num_pairs, window_s = config.windows()
    settle_s = min(SETTLE_S, window_s / 4)
    swarm = PausedGroups([p.pid for p in peers], MetricsFiles(peer_metrics), settle_s=settle_s)
    plain = PausedGroups([b.pid for b in baselines], MetricsFiles(paths), settle_s=settle_s)
    await _wait_started(swarm.metrics, peers, start_grace_s)
    try:
        await _wait_started(plain.metrics, baselines, start_grace_s)
    except RuntimeError as e:
        raise RuntimeError(f"the baseline: {e}: {_tail(logs[0])}") from None
    await asyncio.sleep(WARMUP_S)  # both warm: no window holds a side's first steps
    swarm.pause()
    plain.pause()
    # the windows run in a thread, which a cancelled await leaves running: once told, it
    # skips its remaining windows (the bench's Ctrl-C returns within one window)
    cancelled = threading.Event()

    def gated(side: PausedGroups):
        return lambda seconds: None if cancelled.is_set() else side(seconds)

    try:
        return await asyncio.to_thread(
            interleave, gated(plain), gated(swarm), num_pairs=num_pairs, window_s=window_s
        )
    except BaseException:
        cancelled.set()
        raise
    finally:
        swarm.resume()
        plain.resume()


def _tail(log: Path) -> list[str]:
    return log.read_text(errors="replace").strip().splitlines()[-3:]


def _curve(path: Path) -> list[tuple[int, float]]:
    """(samples seen, loss of the line's last step) per metrics line."""
    seen, curve = 0, []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        seen += record["samples"]
        if record["loss"] is not None:
            curve.append((seen, record["loss"]))
    return curve


def loss_at(curve: list[tuple[int, float]], num_samples: int) -> float | None:
    """The baseline's mean line loss over the ``LOSS_WINDOW_SAMPLES`` samples before it had seen
    ``num_samples`` (None if it never got that far)."""
    if not curve or curve[-1][0] < num_samples:
        return None
    before = [(seen, loss) for seen, loss in curve if seen <= num_samples]
    window = [loss for seen, loss in before if seen > num_samples - LOSS_WINDOW_SAMPLES]
    if not window:
        window = [before[-1][1]] if before else [curve[0][1]]
    return sum(window) / len(window)


def window_fields(run: dict, samples: int) -> dict:
    """The result fields of an interleaved run (``samples``: what the swarm saw)."""
    windows: Interleaved = run["windows"]
    baselines, spread = run["baselines"], windows.spread
    at_samples = loss_at(run["curve"], samples)

    def rounded(value: float | None, digits: int = 4) -> float | None:
        return None if value is None else round(value, digits)

    def mean(key: str) -> float | None:  # over the baseline processes, as the swarm's over peers
        values = [b[key] for b in baselines if b[key] is not None]
        return sum(values) / len(values) if values else None

    return {
        "samples_per_s": round(windows.median_rate(1), 1),
        "baseline_samples_per_s": round(windows.median_rate(0), 1),
        "baseline_final_loss": rounded(mean("recent_loss")),
        "ratio": round(spread.ratio_p50, 3),
        "baseline_samples": sum(b["num_samples"] for b in baselines),
        "baseline_loss_at_samples": rounded(at_samples),
        "baseline_eval_loss": rounded(mean("eval_loss")),
        **spread.fields(),
        "window_s": round(windows.window_s, 3),
        "windows_samples_per_s": [rounded(r, 1) for r in windows.rates_b],
        "baseline_windows_samples_per_s": [rounded(r, 1) for r in windows.rates_a],
    }
