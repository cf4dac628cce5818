"""``peer bench train``: a swarm of real ``peer join`` processes against plain PyTorch loops.

The baseline (:mod:`peer.bench.baseline_run`: plain PyTorch loops in processes of their own; by
default one per peer with that peer's torch threads and data seed, ``--baseline single`` one with
all the cores) and the swarm (a bootstrap node in this process and N peer processes whose torch
threads sum to the machine's cores) are measured in alternate windows over the same stretch of time:
about ``seconds / window_s`` pairs (40 at the defaults: 1-s windows), in the order baseline-swarm,
swarm-baseline, ... (:mod:`peer.bench.pairs`, :mod:`peer.bench.train_windows`). While one side is
measured, the other's process groups are stopped (SIGSTOP), and continued (SIGCONT) for its own
window (:mod:`peer.bench.windows`): the whole swarm pauses at once, so no peer sees another stall.
Its clocks jump by the pause (up to two windows), which stays under the waits nothing raises (an
RPC's 5 s, the DHT records' 20-s lifetime); the adaptive waits, which loopback makes short, are
floored above it (``--min-deadline``, :meth:`TrainBenchConfig.pause_floor_s`), so no round fails
because of a pause, and a peer's rate skips the pause (``peer join``'s SIGCONT handler,
:func:`peer.swarm.progress.note_continued`). With ``--peers 1`` the lone peer talks only to the
bootstrap node, which keeps serving in this process throughout. The first ``SETTLE_S`` of each
window are not measured on either side (right after a pause the peers extrapolate each other's
progress records by the pause). A machine whose speed drifts, or another process's burst, then slows
both sides of a pair alike, or one pair only: the ratio is the median of the pairs' ratios
(``ratio_p50``, also ``ratio``), ``samples_per_s`` and ``baseline_samples_per_s`` the medians over
windows, and ``ratio_iqr``, ``ratio_min``, ``ratio_max`` say how much one pair can be trusted.

A window's rate is read from the side's metrics streams (a line every ``METRICS_INTERVAL_S``):
the samples of the lines written inside the window, after the first one, over the time between
the first and the last (summed over peers). Both sides being processes of their own, measured
and paused alike, neither shares an interpreter or a thread pool with the bench (a 2-thread
OpenMP pool collapses very differently from one process to another on a loaded host). The peers
wait for each other before their clocks start (``--wait-for-peers``), and the windows start once
each one has reported samples, so start-up (imports, joining) is outside the measured time. Peer
``i`` reads data seed ``i``, as its matched plain loop does (a single loop reads seed 0, as
peer 0 does). Why matched by default: on a 2-vCPU virtual machine two 1-thread processes did
1.5-1.9x the work of one 2-thread process, a factor that moved from minute to minute; against
one 2-thread loop, two 1-thread peers measured that factor more than the swarm. The baseline's
processes fix glibc's malloc thresholds as every peer does by default (:mod:`peer.train.allocator`):
the ratio measures the peers' machinery, not the allocator.

In ``epochs`` mode the baseline (:mod:`peer.bench.baseline`, in this process) trains its steps
first, then the swarm (this compares losses, not rates); without the baseline the swarm trains
``seconds`` unpaused.

Contract fields (DESIGN.md): ``backend, peers, task, seconds, samples_per_s,
baseline_samples_per_s, final_loss, baseline_final_loss, rounds``. Extra fields: ``ratio``
(``ratio_p50``; without windows, samples_per_s / baseline_samples_per_s), ``ratio_p50,
ratio_iqr, ratio_min, ratio_max, num_pairs, ratios`` (every pair's swarm / baseline),
``window_s``, ``windows_samples_per_s`` and ``baseline_windows_samples_per_s`` (each window's
rate, in order), ``samples`` and ``baseline_samples`` (samples seen, windows and untimed starts
included), ``baseline_loss_at_samples`` (the baseline's loss when it had seen as many samples as
the swarm: loss per sample seen), ``runs_ratio`` and ``runs_samples_per_s`` (every run's figures
with ``--repeat``), ``delay_update`` (the peers' ``--delay-update``), ``failed_rounds`` and
``round_overhead_s`` (mean seconds per round spent outside the all-reduce transfer:
matchmaking and waiting for the group),
``peak_rss_mb_per_peer`` and ``peak_pss_mb_per_peer`` (each peer's process tree, hivemind's
processes and its p2pd included; RSS sampled every second, PSS every 10 s, which is enough for
memory that is flat once training runs; the mean over peers of each one's peak).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

from dht.config import DHTConfig
from dht.gc_policy import settle as settle_gc
from dht.identity import PeerIdentity
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.bench.processes import STOP_GRACE_S, sample_memory, stop_process_group
from peer.bench.train_config import TrainBenchConfig
from peer.bench.train_windows import METRICS_INTERVAL_S, run_windows, window_fields
from peer.run.flags import join_command
from peer.train.allocator import steady_allocator

logger = logging.getLogger(__name__)
RUN_ID = "bench-train"
# Seconds a peer may take to start (imports, joining, waiting for the others) on a loaded machine.
START_GRACE_S = 120.0
# AUTOGROUP_NOTE: a session of its own would put each peer in a scheduler autogroup of its own
# (/proc/sys/kernel/sched_autogroup_enabled): on a loaded host N peers would then get N shares
# of the CPU against the baseline's one. Every process of the bench shares the bench's session.
# what runs while the peers train: handed their processes and metrics files
Schedule = Callable[[list, list[Path]], Awaitable[None]]


def peer_command(
    config: TrainBenchConfig, url: str, index: int, metrics_file: Path | None = None
) -> list[str]:
    """The ``peer join`` command line of peer ``index``; with ``metrics_file`` (interleaved
    windows), a fine metrics stream there and a time bound that the bench's own stop precedes.
    """
    schedule = config.lr_schedule != "constant" or config.warmup_epochs
    min_deadline = None
    if metrics_file is not None:
        stop = dict(max_time=4 * config.seconds + START_GRACE_S)
        min_deadline = config.pause_floor_s()
    elif config.epochs is None:
        stop = dict(max_time=config.seconds)
    else:
        stop = dict(max_epochs=config.epochs)
    return [
        sys.executable,
        *join_command(
            backend=config.backend,
            run_id=RUN_ID,
            initial_peers=[url],
            task=config.task,
            torch_threads=max(1, config.num_threads // config.num_peers),
            target_batch_size=config.target_batch_size,
            lr=config.lr,
            mode=config.mode,
            delay_update=config.delay_update or None,
            seed=index,
            wait_for_peers=config.num_peers,
            metrics_file=metrics_file,
            metrics_interval=METRICS_INTERVAL_S if metrics_file is not None else None,
            lr_schedule=config.lr_schedule if schedule else None,
            warmup_epochs=config.warmup_epochs if schedule else None,
            min_lr_ratio=config.min_lr_ratio if schedule else None,
            min_deadline=min_deadline if config.backend == "native" else None,
            task_option=config.all_task_options(),
            **stop,
        ),
    ]


async def _run_peers(config: TrainBenchConfig, during: Schedule | None = None) -> list[dict]:
    """Start the bootstrap node and the peers; with ``during``, run it once they train (it is
    handed the peers' processes and metrics files) and then stop them; returns their summaries.
    """
    async with AsyncExitStack() as stack:
        if config.backend == "hivemind":
            from peer.hivemind.backend import HivemindBootstrap

            address = stack.enter_context(HivemindBootstrap()).address
        else:
            node = await stack.enter_async_context(
                open_node(PeerIdentity.generate(), TransportConfig(), DHTConfig())
            )
            address = node.address
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="vp-bench-train-"))
        metrics = [Path(directory) / f"metrics-{i}.jsonl" for i in range(config.num_peers)]
        processes = [
            await asyncio.create_subprocess_exec(
                *peer_command(config, address, index, metrics[index] if during else None),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # its own process group, which hivemind's processes and p2pd daemons join; the
                # bench's session (see AUTOGROUP_NOTE)
                process_group=0,
            )
            for index in range(config.num_peers)
        ]
        peaks = [[0, 0] for _ in processes]
        sampler = asyncio.create_task(sample_memory(processes, peaks))
        talks = [asyncio.create_task(p.communicate()) for p in processes]
        try:
            if during is not None:
                try:
                    await during(processes, metrics)
                except RuntimeError:
                    await _raise_for_failed(processes, talks)
                    raise
                for process in processes:  # SIGTERM: each peer leaves and prints its summary
                    os.killpg(process.pid, signal.SIGCONT)
                    process.terminate()
                bound_s = STOP_GRACE_S
            else:
                bound_s = config.seconds if config.epochs is None else config.timeout_s
            async with asyncio.timeout(bound_s + START_GRACE_S):
                outputs = await asyncio.gather(*talks)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await asyncio.gather(*(stop_process_group(p) for p in processes))
            for talk in talks:
                talk.cancel()
            await asyncio.gather(*talks, return_exceptions=True)
    return _summaries(processes, outputs, peaks)


async def _raise_for_failed(processes, talks) -> None:
    """Raise with the stderr of a peer that exited with an error, if one did."""
    for process, talk in zip(processes, talks, strict=True):
        if process.returncode not in (None, 0):
            _, stderr = await talk
            tail = stderr.decode().strip().splitlines()[-3:]
            raise RuntimeError(f"a peer failed (exit {process.returncode}): {tail}")


def _summaries(processes, outputs, peaks) -> list[dict]:
    summaries = []
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        lines = stdout.decode().strip().splitlines()
        if process.returncode != 0 or not lines:
            tail = stderr.decode().strip().splitlines()[-3:]
            raise RuntimeError(f"a peer failed (exit {process.returncode}): {tail}")
        summaries.append(json.loads(lines[-1]))
    for summary, (rss, pss) in zip(summaries, peaks, strict=True):
        summary["peak_rss_bytes"], summary["peak_pss_bytes"] = rss, pss
    return summaries


def run_train_bench(config: TrainBenchConfig) -> dict:
    """Run the baseline and the swarm (interleaved in windows when both train for ``seconds``);
    returns the contract JSON object."""
    # the peers fix glibc's malloc thresholds (peer join's default): so does the baseline, so
    # that the ratio measures the peers' machinery, not the allocator (peer.train.allocator)
    steady_allocator()
    settle_gc()  # the collector's policy of peer join too (dht.gc_policy)
    if config.run_baseline and config.epochs is None:
        runs: list[dict] = []

        async def schedule(processes, metrics: list[Path]) -> None:
            runs.append(await run_windows(config, processes, metrics, start_grace_s=START_GRACE_S))

        result = _swarm_fields(config, asyncio.run(_run_peers(config, during=schedule)))
        return result | window_fields(runs[0], result["samples"]) | {"baseline": config.baseline}
    baseline = _baseline(config) if config.run_baseline else None
    if baseline is not None:
        baseline.train(max_steps=config.epochs)
    result = _swarm_fields(config, asyncio.run(_run_peers(config)))
    if baseline is not None:
        result |= _baseline_fields(baseline.result(), result) | {"baseline": "single"}
    return result


def _swarm_fields(config: TrainBenchConfig, summaries: list[dict]) -> dict:
    losses = [s["final_loss"] for s in summaries if s["final_loss"] is not None]
    num_rounds = sum(s["num_rounds"] for s in summaries)
    overhead_s = sum(s.get("matchmaking_s", 0.0) for s in summaries)
    eval_losses = [s["eval_loss"] for s in summaries if s.get("eval_loss") is not None]
    return {
        "backend": config.backend,
        "peers": config.num_peers,
        "task": config.task,
        "delay_update": config.delay_update,
        "seconds": config.seconds
        if config.epochs is None
        else round(max(s["seconds"] for s in summaries), 2),
        "samples_per_s": round(sum(s["samples_per_s"] for s in summaries), 1),
        "baseline_samples_per_s": None,
        "final_loss": round(sum(losses) / len(losses), 4) if losses else None,
        "baseline_final_loss": None,
        "rounds": max(s["epoch"] for s in summaries),
        "ratio": None,
        "samples": sum(s["num_samples"] for s in summaries),
        "baseline_samples": None,
        "baseline_loss_at_samples": None,
        "failed_rounds": sum(s["num_failed_rounds"] for s in summaries),
        "round_overhead_s": round(overhead_s / num_rounds, 4) if num_rounds else None,
        "eval_loss": round(sum(eval_losses) / len(eval_losses), 4) if eval_losses else None,
        "baseline_eval_loss": None,
        "baseline": None,  # which plain loops (TrainBenchConfig.baseline); None without any
        "peak_rss_mb_per_peer": _mean_mb(s["peak_rss_bytes"] for s in summaries),
        "peak_pss_mb_per_peer": _mean_mb(s["peak_pss_bytes"] for s in summaries),
    }


def _baseline_fields(baseline, swarm: dict) -> dict:
    at_samples = baseline.loss_at(swarm["samples"])
    return {
        "baseline_samples_per_s": round(baseline.samples_per_s, 1),
        "baseline_final_loss": round(baseline.final_loss, 4),
        "ratio": round(swarm["samples_per_s"] / baseline.samples_per_s, 3),
        "baseline_samples": baseline.num_samples,
        "baseline_loss_at_samples": None if at_samples is None else round(at_samples, 4),
        "baseline_eval_loss": None if baseline.eval_loss is None else round(baseline.eval_loss, 4),
    }


def run_train_bench_repeated(config: TrainBenchConfig, repeat: int) -> dict:
    """Run the benchmark ``repeat`` times, one after another; returns the run with the median
    ``ratio`` (the lower middle one for an even count; ``samples_per_s`` without a baseline)
    and, in ``runs_ratio`` and ``runs_samples_per_s``, every run's figure in order.

    Each run's ratio is already a median over pairs of windows (``ratio_iqr`` its spread);
    repeating adds the spread between runs (start-up, the data each run sees).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    results = [run_train_bench(config) for _ in range(repeat)]
    key = "ratio" if config.run_baseline else "samples_per_s"
    median = sorted(results, key=lambda result: result[key])[(repeat - 1) // 2]
    return median | {
        "runs_ratio": [result["ratio"] for result in results],
        "runs_samples_per_s": [result["samples_per_s"] for result in results],
    }


def _mean_mb(values) -> float:
    values = list(values)
    return round(sum(values) / len(values) / 2**20, 1) if values else 0.0


def _baseline(config: TrainBenchConfig):
    import torch

    from peer.bench.baseline import BaselineRun
    from peer.train.schedules import make_lr_schedule
    from peer.train.tasks import load_task

    options = dict(option.split("=", 1) for option in config.all_task_options())
    return BaselineRun(
        load_task(config.task, options),
        num_threads=config.num_threads,
        total_batch_size=config.target_batch_size,
        make_optimizer=lambda params: torch.optim.Adam(params, lr=config.lr),
        lr_schedule=make_lr_schedule(
            config.lr_schedule,
            warmup_epochs=config.warmup_epochs,
            total_epochs=config.epochs,
            min_lr_ratio=config.min_lr_ratio,
        ),
    )
