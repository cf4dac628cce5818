"""The Chrome/Perfetto trace: events per phase with exact times, rounds and epochs, a bounded
size on long runs, and a readable file after the peer is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.profiling.phases import PHASES
from peer.profiling.profiler import Profiler, ProfilerConfig
from peer.profiling.trace import EPOCHS_TID, PHASES_TID, ROUNDS_TID, TraceWriter
from tests.peer.profiling.test_phases import FakeTime

pytestmark = pytest.mark.timeout(60)


def load(path: Path) -> list[dict]:
    events = json.loads(path.read_text())
    assert isinstance(events, list)
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= set(event)
        assert event["ph"] in ("X", "i", "C", "M")
    return events


def slices(events: list[dict], tid: int) -> list[tuple[str, float, float]]:
    return [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == tid]


def fake_profiler(tmp_path: Path, **config) -> tuple[Profiler, FakeTime]:
    fake = FakeTime()
    profiler = Profiler(
        ProfilerConfig(trace_path=tmp_path / "trace.json", log_verdicts=False, **config),
        process_name="peer test",
        now=fake,
    )
    return profiler, fake


def test_every_phase_gets_slices_with_exact_times(tmp_path):
    profiler, fake = fake_profiler(tmp_path)
    clock = profiler.clock
    fake.advance(1.0)  # start-up: other
    for phase in PHASES[:-1]:
        with clock.phase(phase):
            fake.advance(0.5)
        fake.advance(0.00001)  # a gap of 10 us between two phases: not worth a slice
    clock.snapshot()  # splits the open stretch; the writer merges it back
    fake.advance(0.25)
    profiler.close()
    events = load(tmp_path / "trace.json")
    got = slices(events, PHASES_TID)
    expected = [("other", 0.0, 1e6)]
    t_us = 1e6
    for phase in PHASES[:-1]:
        expected.append((phase, t_us, 0.5e6))
        t_us += 0.5e6 + 10
    expected.append(("other", t_us - 10, 0.25e6 + 10))
    assert [name for name, _, _ in got] == [name for name, _, _ in expected]
    for (_, ts, dur), (_, ts_expected, dur_expected) in zip(got, expected, strict=True):
        assert ts == pytest.approx(ts_expected, abs=0.01)
        assert dur == pytest.approx(dur_expected, abs=0.01)
    names = {(e["name"], e["tid"]) for e in events if e["ph"] == "M"}
    assert {("process_name", 0), ("thread_name", PHASES_TID), ("thread_name", EPOCHS_TID)} <= names


def test_the_averagers_report_splits_the_round_into_matchmaking_and_allreduce(tmp_path):
    profiler, fake = fake_profiler(tmp_path)
    clock = profiler.clock
    with clock.phase("optimizer"):
        fake.advance(0.1)
        with clock.phase("matchmaking"):  # the blocking averaging call
            fake.advance(2.0)
        clock.transfer(1.5, "matchmaking", "allreduce")  # the averager said: 1.5 s all-reduce
        fake.advance(0.1)
    profiler.on_epoch(1)
    profiler.close()
    events = load(tmp_path / "trace.json")
    phase_slices = slices(events, PHASES_TID)
    assert [name for name, _, _ in phase_slices] == [
        "optimizer",
        "matchmaking",
        "allreduce",
        "optimizer",
    ]
    _, mm_ts, mm_dur = phase_slices[1]
    _, ar_ts, ar_dur = phase_slices[2]
    assert mm_dur == pytest.approx(0.5e6) and ar_dur == pytest.approx(1.5e6)
    assert ar_ts == pytest.approx(mm_ts + mm_dur)
    (round_slice,) = [e for e in events if e["ph"] == "X" and e["tid"] == ROUNDS_TID]
    assert round_slice["ts"] == pytest.approx(mm_ts) and round_slice["dur"] == pytest.approx(2e6)
    assert round_slice["args"] == {"matchmaking_s": 0.5, "allreduce_s": 1.5}
    (epoch,) = [e for e in events if e["ph"] == "X" and e["tid"] == EPOCHS_TID]
    assert epoch["name"] == "epoch 0" and epoch["dur"] == pytest.approx(2.2e6)
    assert epoch["args"]["allreduce_pct"] == pytest.approx(100 * 1.5 / 2.2, abs=0.01)
    assert epoch["args"]["optimizer_pct"] == pytest.approx(100 * 0.2 / 2.2, abs=0.01)


def test_size_is_bounded_on_a_long_run_and_epochs_go_on(tmp_path):
    max_bytes = 64 * 1024
    profiler, fake = fake_profiler(tmp_path, trace_max_bytes=max_bytes)
    clock = profiler.clock
    num_steps = 20_000  # about 100,000 stretches: some 8 MB of slices without the cap
    for step in range(num_steps):
        for phase in ("data", "h2d", "forward", "backward", "optimizer"):
            with clock.phase(phase):
                fake.advance(0.001)
        if step % 100 == 99:
            profiler.on_epoch(step // 100 + 1)
    writer = profiler.trace
    profiler.close()
    size = (tmp_path / "trace.json").stat().st_size
    assert writer.phases_stopped
    assert max_bytes <= size <= 2 * max_bytes + 4096
    events = load(tmp_path / "trace.json")
    notes = [e for e in events if e["ph"] == "i"]
    assert len(notes) == 1 and "stop" in notes[0]["name"]
    epochs = [e for e in events if e["ph"] == "X" and e["tid"] == EPOCHS_TID]
    last_phase_ts = max(e["ts"] for e in events if e["ph"] == "X" and e["tid"] == PHASES_TID)
    # the per-epoch breakdown continues well past the last phase slice
    assert epochs[-1]["ts"] > 2 * last_phase_ts
    assert epochs[-1]["args"]["forward_pct"] == pytest.approx(20.0, abs=0.01)


def test_a_writer_that_is_never_closed_leaves_events_up_to_its_last_flush(tmp_path):
    writer = TraceWriter(tmp_path / "t.json", max_bytes=1 << 20)
    for i in range(1000):
        writer.segment("forward" if i % 2 else "data", i * 1.0, i + 1.0)
    writer.flush()
    text = (tmp_path / "t.json").read_text()
    assert not text.rstrip().endswith("]")
    events = json.loads(text + "\n]")  # what trace viewers do with an unterminated array
    assert len(slices(events, PHASES_TID)) == 999  # the last stretch is still held open
    writer.close()


@pytest.mark.timeout(120)
def test_a_killed_peer_leaves_a_trace_that_parses(tmp_path):
    trace = tmp_path / "trace.json"
    command = [
        sys.executable,
        "-m",
        "peer",
        "--log-level",
        "WARNING",
        "join",
        "--task-option",
        "hidden_dim=32",
        "--torch-threads",
        "1",
        "--target-batch-size",
        "128",
        "--profile-interval",
        "0.2",
        "--max-time",
        "90",
        "--trace",
        str(trace),
    ]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        # flushed at each rolling summary: wait for some epochs' worth of slices
        while time.monotonic() < deadline and process.poll() is None:
            if trace.exists() and trace.stat().st_size > 50_000:
                break
            time.sleep(0.1)
        assert process.poll() is None, "the peer ended before it was killed"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = trace.read_text()
    assert text.startswith("[") and not text.rstrip().endswith("]")
    events = json.loads(text + "\n]")
    names = {name for name, _, _ in slices(events, PHASES_TID)}
    # on CPU nothing is copied to a device, so there is no h2d phase to show
    assert {"data", "forward", "backward", "optimizer"} <= names
    assert any(e["tid"] == EPOCHS_TID for e in events if e["ph"] == "X")
