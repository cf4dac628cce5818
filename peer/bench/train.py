"""``peer bench train``: a swarm of real ``peer join`` processes against one plain PyTorch loop.

The baseline (:mod:`peer.bench.baseline`) runs alone on the machine, with torch threads = the
machine's cores, in two halves of ``seconds / 2``: one before the swarm and one after it, the
second continuing the first's model, optimizer and data (an A-B-A design: when the machine's
speed drifts during the run, as a shared cloud host's does by several percent over tens of
seconds, both sides see the same average). In between, a bootstrap node (in this process) and N
peer processes, whose torch threads sum to the same cores, train for ``seconds``. In ``epochs``
mode the baseline trains its steps in one go, first. The baseline's process fixes glibc's malloc
thresholds as every peer does by default (:mod:`peer.train.allocator`): the ratio measures the
peers' machinery, not the allocator. Peers wait for each other before their
clocks start (``--wait-for-peers``), so start-up (imports, joining) is outside the measured time
and every peer's rate is measured while all of them run. Peer ``i`` reads data seed ``i`` and the
baseline seed 0, as peer 0 does: one peer and the baseline see the same batches, so their losses
compare sample for sample.

Contract fields (DESIGN.md): ``backend, peers, task, seconds, samples_per_s,
baseline_samples_per_s, final_loss, baseline_final_loss, rounds``. Extra fields: ``ratio``
(samples_per_s / baseline_samples_per_s), ``samples`` and ``baseline_samples`` (samples seen),
``baseline_loss_at_samples`` (the baseline's loss when it had seen as many samples as the swarm:
loss per sample seen), ``baseline_samples_per_s_halves`` (the baseline's rate before and after
the swarm: how much the machine drifted), ``runs_ratio`` and ``runs_samples_per_s`` (every
run's figures with ``--repeat``), ``failed_rounds`` and ``round_overhead_s`` (mean
seconds per round spent outside the all-reduce transfer: matchmaking and waiting for the
group), ``peak_rss_mb_per_peer`` and ``peak_pss_mb_per_peer`` (each peer's process tree,
hivemind's processes and its p2pd included; RSS sampled every second, PSS every 10 s, which
is enough for memory that is flat once training runs; the mean over peers of each one's
peak).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from contextlib import AsyncExitStack

import psutil

from dht.config import DHTConfig
from dht.http_config import TransportConfig
from dht.identity import PeerIdentity
from dht.launch import open_node
from peer.run.config import join_command
from peer.train.allocator import steady_allocator

logger = logging.getLogger(__name__)
RUN_ID = "bench-train"
# Seconds a peer may take to start (imports, joining, waiting for the others) on a loaded machine.
START_GRACE_S = 120.0
# Seconds a peer gets to leave the swarm after SIGTERM before it is killed.
STOP_GRACE_S = 20.0
# Seconds between two samples of the peers' resident memory (RSS: cheap to read).
MEMORY_SAMPLE_S = 1.0
# PSS is read less often, from a few seconds after the peers start (past their imports):
# reading it walks the process's page tables (smaps_rollup), and a read every second slowed
# a 2-thread peer on 2 cores by about 2.5%.
PSS_FIRST_S = 5.0
PSS_SAMPLE_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """One ``peer bench train`` run; the defaults are the benchmark contract.

    Attributes:
        backend: ``native`` or ``hivemind``.
        num_peers: peer processes.
        task: task name (``synthetic``, ``charlm``, or ``package.module:function``).
        task_options: extra task options (``KEY=VALUE``), e.g. ``path=...`` for charlm.
        seconds: training seconds, for the baseline and for the swarm each.
        batch_size: samples per local step (None: the task's default, 32 for synthetic).
        target_batch_size: samples per optimizer step, in the swarm and in the baseline.
        lr: Adam's learning rate.
        mode: ``grad``, ``params`` or ``diloco``.
        num_threads: the machine's cores to use (baseline threads; peers split them).
        run_baseline: whether to run the baseline (its fields are null otherwise).
        epochs: train this many optimizer steps (swarm epochs) instead of ``seconds``: for
            statistical efficiency, compared through ``eval_loss`` at the end.
        lr_schedule, warmup_epochs, min_lr_ratio: the LR schedule over epochs (baseline: over
            its optimizer steps), as ``peer join`` takes them.
        timeout_s: bound on the whole swarm run in ``epochs`` mode.
    """

    backend: str = "native"
    num_peers: int = 2
    task: str = "synthetic"
    task_options: tuple[str, ...] = ()
    seconds: float = 20.0
    batch_size: int | None = None
    target_batch_size: int = 2048
    lr: float = 1e-3
    mode: str = "grad"
    num_threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    run_baseline: bool = True
    epochs: int | None = None
    lr_schedule: str = "constant"
    warmup_epochs: int = 0
    min_lr_ratio: float = 0.0
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("num_peers", "target_batch_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.seconds > 0 or not self.lr > 0:
            raise ValueError("seconds and lr must be > 0")

    def all_task_options(self) -> list[str]:
        options = list(self.task_options)
        if self.batch_size is not None:
            options.append(f"batch_size={self.batch_size}")
        return options


def peer_command(config: TrainBenchConfig, url: str, index: int) -> list[str]:
    """The ``peer join`` command line of peer ``index``."""
    schedule = config.lr_schedule != "constant" or config.warmup_epochs
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
            seed=index,
            wait_for_peers=config.num_peers,
            max_time=config.seconds if config.epochs is None else None,
            max_epochs=config.epochs,
            lr_schedule=config.lr_schedule if schedule else None,
            warmup_epochs=config.warmup_epochs if schedule else None,
            min_lr_ratio=config.min_lr_ratio if schedule else None,
            task_option=config.all_task_options(),
        ),
    ]


async def _run_peers(config: TrainBenchConfig) -> list[dict]:
    async with AsyncExitStack() as stack:
        if config.backend == "hivemind":
            from peer.hivemind.backend import HivemindBootstrap

            address = stack.enter_context(HivemindBootstrap()).address
        else:
            node = await stack.enter_async_context(
                open_node(PeerIdentity.generate(), TransportConfig(), DHTConfig())
            )
            address = node.address
        processes = [
            await asyncio.create_subprocess_exec(
                *peer_command(config, address, index),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # its own process group: hivemind's processes and p2pd daemons go with it
                start_new_session=True,
            )
            for index in range(config.num_peers)
        ]
        peaks = [[0, 0] for _ in processes]
        sampler = asyncio.create_task(_sample_memory(processes, peaks))
        try:
            bound_s = config.seconds if config.epochs is None else config.timeout_s
            async with asyncio.timeout(bound_s + START_GRACE_S):
                outputs = await asyncio.gather(*(p.communicate() for p in processes))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await asyncio.gather(*(stop_process_group(p) for p in processes))
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


def tree_memory_bytes(process: psutil.Process, *, pss: bool = True) -> tuple[int, int]:
    """Resident and proportional (PSS) bytes of ``process`` and all its descendants.

    RSS counts the pages forked processes share once per process; PSS splits each shared page
    among its sharers, so the PSS of a process tree is what it really occupies. Processes that
    are gone, or whose PSS cannot be read, count 0 (PSS falls back to RSS). ``pss=False`` reads
    RSS alone (cheap; the PSS returned is 0): PSS walks the process's page tables.
    """
    rss = proportional = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for member in members:
        try:
            info = member.memory_full_info() if pss else member.memory_info()
        except psutil.Error:
            continue
        rss += info.rss
        proportional += getattr(info, "pss", info.rss) if pss else 0
    return rss, proportional


async def _sample_memory(processes: list, peaks: list[list[int]]) -> None:
    """Each peer's process tree (hivemind's processes and p2pd included): the peak RSS, read
    every ``MEMORY_SAMPLE_S``, and the peak PSS, read every ``PSS_SAMPLE_S`` from
    ``PSS_FIRST_S`` on, go into ``peaks``."""
    trees = [psutil.Process(p.pid) for p in processes]
    start_s = time.monotonic()
    next_pss_s = start_s + PSS_FIRST_S
    while True:
        with_pss = time.monotonic() >= next_pss_s
        if with_pss:
            next_pss_s += PSS_SAMPLE_S
        for tree, peak in zip(trees, peaks, strict=True):
            rss, pss = await asyncio.to_thread(tree_memory_bytes, tree, pss=with_pss)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
        await asyncio.sleep(MEMORY_SAMPLE_S)


async def stop_process_group(process: asyncio.subprocess.Process) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and whatever it left
    behind in its process group (hivemind's forked processes and p2pd daemons)."""
    if process.returncode is None:
        process.terminate()
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is empty: everything exited


def run_train_bench(config: TrainBenchConfig) -> dict:
    """Run the baseline, then the swarm; returns the contract JSON object."""
    # the peers fix glibc's malloc thresholds (peer join's default): so does the baseline, so
    # that the ratio measures the peers' machinery, not the allocator (peer.train.allocator)
    steady_allocator()
    baseline = _baseline(config) if config.run_baseline else None
    if baseline is not None:
        if config.epochs is None:
            baseline.train(seconds=config.seconds / 2)
        else:
            baseline.train(max_steps=config.epochs)
    summaries = asyncio.run(_run_peers(config))
    if baseline is not None and config.epochs is None:
        baseline.train(seconds=config.seconds / 2)
    samples = sum(s["num_samples"] for s in summaries)
    losses = [s["final_loss"] for s in summaries if s["final_loss"] is not None]
    rounds = max(s["epoch"] for s in summaries)
    num_rounds = sum(s["num_rounds"] for s in summaries)
    overhead_s = sum(s.get("matchmaking_s", 0.0) for s in summaries)
    samples_per_s = sum(s["samples_per_s"] for s in summaries)
    eval_losses = [s["eval_loss"] for s in summaries if s.get("eval_loss") is not None]
    result = {
        "backend": config.backend,
        "peers": config.num_peers,
        "task": config.task,
        "seconds": config.seconds
        if config.epochs is None
        else round(max(s["seconds"] for s in summaries), 2),
        "samples_per_s": round(samples_per_s, 1),
        "baseline_samples_per_s": None,
        "final_loss": round(sum(losses) / len(losses), 4) if losses else None,
        "baseline_final_loss": None,
        "rounds": rounds,
        "ratio": None,
        "samples": samples,
        "baseline_samples": None,
        "baseline_loss_at_samples": None,
        "failed_rounds": sum(s["num_failed_rounds"] for s in summaries),
        "round_overhead_s": round(overhead_s / num_rounds, 4) if num_rounds else None,
        "eval_loss": round(sum(eval_losses) / len(eval_losses), 4) if eval_losses else None,
        "baseline_eval_loss": None,
        "peak_rss_mb_per_peer": _mean_mb(s["peak_rss_bytes"] for s in summaries),
        "peak_pss_mb_per_peer": _mean_mb(s["peak_pss_bytes"] for s in summaries),
    }
    if baseline is not None:
        halves = [round(n / s, 1) for n, s in baseline.stretches]
        baseline = baseline.result()
        at_samples = baseline.loss_at(samples)
        result |= {
            "baseline_samples_per_s_halves": halves,
            "baseline_samples_per_s": round(baseline.samples_per_s, 1),
            "baseline_final_loss": round(baseline.final_loss, 4),
            "ratio": round(samples_per_s / baseline.samples_per_s, 3),
            "baseline_samples": baseline.num_samples,
            "baseline_loss_at_samples": None if at_samples is None else round(at_samples, 4),
            "baseline_eval_loss": None
            if baseline.eval_loss is None
            else round(baseline.eval_loss, 4),
        }
    return result


def run_train_bench_repeated(config: TrainBenchConfig, repeat: int) -> dict:
    """Run the benchmark ``repeat`` times, one after another; returns the run with the median
    ``ratio`` (the lower middle one for an even count; ``samples_per_s`` without a baseline)
    and, in ``runs_ratio`` and ``runs_samples_per_s``, every run's figure in order.

    On a shared host one run's ratio moves by a few percent with the host's load (see
    ``baseline_samples_per_s_halves``); the median of a few runs does not.
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
