"""The profiler on real peers: a slow loader is data-bound by the delay it injects, a slowed
all-reduce is communication-bound, phases add up to the wall time epoch after epoch, and the
profile record reaches other peers through the DHT. Plus the verdict rules and the rolling
window on a fake clock."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

import peer.swarm.services
from averaging.averager import DecentralizedAverager
from dht.tools.faults import Faults, FaultyTransport
from peer.profiling.metrics_reader import read_metrics, summarize_lines
from peer.profiling.phases import PHASES
from peer.profiling.profiler import Profiler, ProfilerConfig, StepProgress
from peer.profiling.summary import diagnose, nonnegative
from peer.records.buckets import read_every_record
from peer.records.profile import PROFILE_RECORDS_PER_BUCKET, parse_profile, profile_key
from peer.run.config import PeerConfig
from peer.run.runner import PeerRun
from peer.train.tasks import Task
from peer.train.tasks.base import seeded_build, worker_generator
from tests.peer.profiling.test_phases import FakeTime
from tests.peer.run.test_join import config

pytestmark = pytest.mark.timeout(120)
SLEEP_S = 0.05
# what the loader really spent on each batch: its sleep and the making of the batch, the first
# one's generator included (the loader runs in the test's process)
SLEPT_S: list[float] = []


class SlowBatches(IterableDataset):
    """Small random batches, each after a 50 ms sleep."""

    def __init__(self, shard):
        self.shard = shard

    def __iter__(self):
        start = time.perf_counter()
        generator = worker_generator(self.shard)
        while True:
            time.sleep(SLEEP_S)
            inputs = torch.randn(8, 16, generator=generator)
            labels = (inputs.sum(dim=1) > 0).long()
            SLEPT_S.append(time.perf_counter() - start)
            yield inputs, labels
            start = time.perf_counter()


def slow_task() -> Task:
    """A task whose loader sleeps 50 ms per batch
    (``tests.peer.profiling.test_profiler:slow_task``).
    """

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

    return Task(
        name="slow",
        build_model=lambda: seeded_build(0, build),
        train_data=SlowBatches,
        loss_fn=F.cross_entropy,
        batch_size=8,
        yields_batches=True,
    )


# ---- the verdict's rules -------------------------------------------------------------------------


def seconds(**values: float) -> dict[str, float]:
    return {phase: values.get(phase, 0.0) for phase in PHASES}


def test_verdicts_name_the_bottleneck_with_its_evidence():
    verdict = diagnose(seconds(data=46, forward=30, backward=24), 100)
    assert verdict.bottleneck == "data"
    assert verdict.text.startswith("data-loading bound: 46% of wall time waiting for batches")
    # 38 s of all-reduce while sending 190 MB: 40 Mbit/s
    verdict = diagnose(seconds(allreduce=38, matchmaking=5, forward=57), 100, sent_bytes=190e6)
    assert verdict.bottleneck == "communication"
    assert verdict.text.startswith("communication bound: all-reduce 38% at 40 Mbit/s")
    # time lost outweighs compute's larger share once it reaches a quarter
    verdict = diagnose(seconds(matchmaking=24, forward=76), 100)
    assert verdict.bottleneck == "compute"
    verdict = diagnose(seconds(matchmaking=26, forward=74), 100)
    assert verdict.bottleneck == "communication" and "matchmaking 26%" in verdict.text
    verdict = diagnose(seconds(idle=30, forward=40, data=20, other=10), 100)
    assert verdict.bottleneck == "swarm"
    assert verdict.text == "waiting on the swarm: idle 30% of wall time"
    verdict = diagnose(seconds(forward=20, backward=50, optimizer=10, data=20), 100)
    assert verdict.bottleneck == "compute"
    assert "80%" in verdict.text and "backward 50%" in verdict.text
    verdict = diagnose(seconds(data=20, forward=35, allreduce=20, other=25), 100)
    assert verdict.bottleneck == "balanced"
    assert diagnose(seconds(), 0).bottleneck == "balanced"


def test_negative_phases_from_a_split_round_are_taken_from_the_largest():
    fixed = nonnegative(seconds(matchmaking=-0.5, allreduce=2.0, forward=1.0))
    assert fixed == seconds(matchmaking=0.0, allreduce=1.5, forward=1.0)
    assert sum(fixed.values()) == pytest.approx(2.5)


# ---- rolling window and epochs on a fake clock ---------------------------------------------------


def test_rolling_window_and_epoch_summaries_cover_what_they_say():
    fake = FakeTime()
    profiler = Profiler(ProfilerConfig(interval_s=1.0, window_s=4.0, log_verdicts=False), now=fake)
    samples = [0]
    profiler.attach(progress=lambda: StepProgress(3, samples[0], torch.tensor(0.5)))
    clock = profiler.clock
    for second in range(10):  # 10 s: each second 0.75 s data, 0.25 s forward, 8 samples
        with clock.phase("data"):
            fake.advance(0.75)
        with clock.phase("forward"):
            fake.advance(0.25)
        samples[0] += 8
        if second == 4:
            profiler.on_epoch(1)
        if second >= 5:
            with clock.phase("allreduce"):  # the later seconds also all-reduce for 1 s
                fake.advance(1.0)
        profiler.sample()
    window = profiler.sample()
    # the window is the last 4 s (marks one per loop): 2 loops of 2 s
    assert window.wall_s == pytest.approx(4.0)
    assert window.seconds["allreduce"] == pytest.approx(2.0)
    assert window.seconds["data"] == pytest.approx(1.5)
    assert window.samples_per_s == pytest.approx(16 / 4.0)
    record = profiler.make_record(peer_id="ab" * 32, time_s=1000.0)
    assert record.epoch == 3 and record.loss == 0.5 and record.time == 1000.0
    assert record.fractions["allreduce"] == pytest.approx(0.5)
    assert record.bottleneck == "communication"
    (epoch,) = profiler.epochs
    assert epoch.epoch == 0 and epoch.summary.wall_s == pytest.approx(5.0)
    assert epoch.summary.seconds["data"] == pytest.approx(3.75)
    assert epoch.summary.samples == 40
    run = profiler.run_summary()
    assert run.wall_s == pytest.approx(15.0)
    assert sum(run.seconds.values()) == pytest.approx(run.wall_s)
    profiler.close()


# ---- a real peer with a slow loader --------------------------------------------------------------


def test_a_slow_loader_makes_data_the_largest_phase_by_the_injected_delay(tmp_path):
    SLEPT_S.clear()
    metrics = tmp_path / "metrics.jsonl"
    run = PeerRun(
        config(
            task="tests.peer.profiling.test_profiler:slow_task",
            task_option=[],
            max_steps=40,  # not a time: a loaded machine oversleeps each 50 ms batch 2-3x
            metrics_file=metrics,
            metrics_interval=0.5,
            profile_interval=0.5,
            profile_window=2.0,
            trace=tmp_path / "trace.json",
        )
    )
    summary = run.run()
    lines = read_metrics([metrics])
    assert not lines.num_bad_lines
    (peer_lines,) = lines.peers.values()
    stream = summarize_lines(peer_lines)
    # every batch was drawn between the stream's first and last line: the sleeps it measured
    # are the data time the profiler must find, up to the loader's own few microseconds
    assert summary.num_steps == len(SLEPT_S) == 40
    expected = sum(SLEPT_S) / stream.wall_s
    fractions = stream.fractions()
    # of the workload's phases (a loaded machine's wait for a CPU is the host's: the verdict too
    # judges the rest)
    assert max((p for p in fractions if p != "cpu_wait"), key=fractions.get) == "data"
    # a sleep's end may wait for a CPU on a loaded machine: the profiler says so (cpu_wait)
    assert expected - 0.005 <= fractions["data"] + fractions["cpu_wait"]
    assert fractions["data"] <= expected + 0.03
    verdict = stream.verdict()
    assert verdict.bottleneck == "data"
    # its share is of the time not spent waiting for a CPU
    shown = verdict.text.removeprefix("data-loading bound: ").split("% of wall time")[0]
    assert int(shown) == pytest.approx(100 * fractions["data"] / (1 - fractions["cpu_wait"]), abs=1)
    # the live rolling summary (what the DHT record said) agrees
    record = run.profiler.last_record
    assert record is not None and record.bottleneck == "data"
    assert record.fractions["data"] == pytest.approx(expected, abs=0.1)
    assert record.samples_per_s == pytest.approx(8 / SLEEP_S, rel=0.5)
    events = json.loads((tmp_path / "trace.json").read_text())
    data_us = sum(e["dur"] for e in events if e.get("name") == "data" and e["ph"] == "X")
    assert data_us / 1e6 >= sum(SLEPT_S)


# ---- two real peers, with and without a slowed all-reduce ----------------------------------------


class SlowStreams(FaultyTransport):
    """Delays the all-reduce's streams (opening, every chunk sent and received); RPCs (DHT,
    matchmaking) go through untouched."""

    async def call(self, address, name, payload, *, timeout_s=None):
        return await self.inner.call(address, name, payload, timeout_s=timeout_s)


def run_pair(monkeypatch, *, delay_s: float, num_epochs: int) -> tuple[list[PeerRun], list]:
    """Two peers training together for ``num_epochs`` (left open; the caller closes them), and
    each one's perf_counter at every epoch boundary."""

    def make_averager(tensors, *, transport, **kwargs):
        slowed = SlowStreams(transport, Faults(delay_s=delay_s))
        return DecentralizedAverager(tensors, transport=slowed, **kwargs)

    monkeypatch.setattr(peer.swarm.services, "DecentralizedAverager", make_averager)
    runs, stamps = [], []
    for seed in (1, 2):
        initial = [runs[0].address] if runs else []
        run = PeerRun(
            config(seed=seed, max_epochs=num_epochs, target_batch_size=64, initial_peers=initial)
        )
        times: list[float] = []
        on_epoch = run.profiler.on_epoch

        def stamped(epoch, on_epoch=on_epoch, times=times):
            times.append(time.perf_counter())
            on_epoch(epoch)

        run.profiler.on_epoch = stamped  # the profiler's epoch boundary, stamped
        run.start()
        runs.append(run)
        stamps.append(times)
    for run in runs:
        run.loop_thread.run(run.services.tracker.refresh())
    threads = [
        threading.Thread(target=run.trainer.run, kwargs={"stop_event": run.stop_event,
                                                        "on_step": run._on_step})
        for run in runs
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    assert not any(thread.is_alive() for thread in threads)
    return runs, stamps


def epochs_total(run: PeerRun) -> tuple[dict[str, float], float, int]:
    """Seconds per phase, wall time and bytes sent over every epoch but the first (start-up)."""
    epochs = list(run.profiler.epochs)[1:]
    totals = {p: sum(e.summary.seconds[p] for e in epochs) for p in PHASES}
    return totals, sum(e.summary.wall_s for e in epochs), sum(e.summary.sent_bytes for e in epochs)


@pytest.mark.timeout(180)
def test_a_slowed_allreduce_is_communication_bound_and_phases_add_up(monkeypatch):
    num_epochs, delay_s = 6, 0.15
    fast, _ = run_pair(monkeypatch, delay_s=0.0, num_epochs=num_epochs)
    for run in fast:
        run.close()
    slow, stamps = run_pair(monkeypatch, delay_s=delay_s, num_epochs=num_epochs)
    try:
        parsed = slow[0].loop_thread.run(
            read_every_record(
                slow[0].services.node,
                profile_key("vp-run"),
                num_peers=2,
                records_per_bucket=PROFILE_RECORDS_PER_BUCKET,
                parse=parse_profile,
            )
        )
    finally:
        for run in slow:
            run.close()
    for fast_run, slow_run, times in zip(fast, slow, stamps, strict=True):
        assert slow_run.hook.epoch == num_epochs and slow_run.hook.stats.num_failed_rounds == 0
        fast_s, _, _ = epochs_total(fast_run)
        slow_s, wall_s, sent_bytes = epochs_total(slow_run)
        rounds = num_epochs - 1  # the rounds that ended epochs 1..n-1
        # opening the stream, sending the part and receiving its average: 3 delays at least
        assert slow_s["allreduce"] / rounds >= fast_s["allreduce"] / rounds + 2 * delay_s
        # over all epochs, the profiler's all-reduce is what the averager reported, less what
        # the loop thread spent waiting for a CPU in the round (cpu_wait; a reading in the
        # middle of a round takes it from matchmaking, which holds the round until it ends)
        profiled_s = sum(e.summary.seconds["allreduce"] for e in slow_run.profiler.epochs)
        taken = slow_run.profiler.clock.cpu_wait_taken()
        reported_s = slow_run.hook.stats.allreduce_s
        assert profiled_s <= reported_s * (1 + 1e-6)
        assert profiled_s + taken["allreduce"] + taken["matchmaking"] >= reported_s * (1 - 1e-6)
        verdict = diagnose(slow_s, wall_s, sent_bytes=sent_bytes)
        assert verdict.bottleneck == "communication", verdict.text
        assert verdict.text.startswith("communication bound: all-reduce")
        assert max(slow_s, key=slow_s.get) == "allreduce"
        # phases add up to the wall time the test measured between its first and last epoch
        assert len(times) == num_epochs
        measured_s = times[-1] - times[0]
        assert sum(slow_s.values()) == pytest.approx(measured_s, rel=0.02)
        assert slow_s["other"] < 0.05 * measured_s
    # each peer's record reached the other's DHT node, signed by its owner
    by_peer = {record.peer_id: record for record in parsed if record is not None}
    assert set(by_peer) == {run.identity.peer_id for run in slow}
    for record in by_peer.values():
        assert sum(record.fractions.values()) == pytest.approx(1.0, abs=0.01)
        assert record.fractions["allreduce"] > 0


@pytest.mark.timeout(120)
def test_bench_profiler_prints_the_contract_json():
    command = [sys.executable, "-m", "peer", "bench", "profiler"]
    command += ["--repetitions", "4", "--steps", "3", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=100, check=True)
    fields = json.loads(result.stdout.strip().splitlines()[-1])
    assert fields["overhead_ratio"] > 0 and fields["vs_pytorch_ratio"] > 0
    for name in ("overhead", "vs_pytorch"):  # the median of 4 pairwise ratios, with its spread
        low, high = fields[f"{name}_ratio_min"], fields[f"{name}_ratio_max"]
        assert low <= fields[f"{name}_ratio"] <= high
        assert 0 <= fields[f"{name}_ratio_iqr"] <= high - low + 1e-4
    assert fields["num_pairs"] == 4
    # summaries and metrics lines at a peer's default intervals (peer join's)
    assert fields["sample_interval_s"] == PeerConfig().profile_interval
    assert fields["metrics_interval_s"] == PeerConfig().metrics_interval
    assert fields["step_ms_off"] > 0 and fields["step_ms_profiled"] > 0
    fractions = fields["fractions"]
    assert set(fractions) == set(PHASES)
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-3)
    # a local step's phases are all there; nothing of a swarm's
    assert all(fractions[phase] > 0 for phase in ("data", "forward", "backward", "optimizer"))
    assert fractions["allreduce"] == fractions["matchmaking"] == 0
    assert fields["trace_events"] > 4 * 3 * 3  # at least the phase slices of the profiled steps
