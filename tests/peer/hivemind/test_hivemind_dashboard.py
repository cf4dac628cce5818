"""The dashboard shows a hivemind swarm: two ``peer join --backend hivemind`` processes on
loopback, read through the bootstrap's hivemind.DHT (rendered to a fixed-size Console) and by
``peer monitor --backend hivemind --once``.

The expected peer names come from the peers' own logs, decoded with hivemind's ``PeerID`` (not
with the code under test); epochs are bounded by the peers' final summaries. Needs the
``[hivemind]`` extra.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

pytest.importorskip("hivemind", reason="the hivemind backend needs the [hivemind] extra")

from hivemind.p2p import PeerID

from monitor.config import MonitorConfig
from monitor.records import ThreadedSwarmReader
from monitor.render import render_dashboard
from peer.hivemind.backend import HivemindBootstrap
from peer.hivemind.swarm import HivemindSwarmRecords
from tests.peer.hivemind.test_hivemind_backend import TASK_OPTIONS, _left_behind

pytestmark = pytest.mark.timeout(240)
RUN_ID = "hm-dash"
TARGET_BATCH = 1024
TRAIN_S = 150.0  # an upper bound: the test stops the peers once it has seen what it checks
WIDTH, HEIGHT = 160, 48
JOINED = re.compile(r"hivemind peer (\w+) \(dashboard id (\w{8})\) joined")


def _peer_args(address: str, seed: int) -> list[str]:
    args = [
        sys.executable, "-m", "peer", "--log-level", "INFO", "join",
        "--backend", "hivemind",
        "--run-id", RUN_ID,
        "--initial-peers", address,
        "--torch-threads", "1",
        "--target-batch-size", str(TARGET_BATCH),
        "--matchmaking-time", "2",
        "--averaging-timeout", "10",
        "--seed", str(seed),
        "--max-time", str(TRAIN_S),
        "--wait-for-peers", "2",
        "--wait-for-peers-timeout", "60",
        "--publish-interval", "0.5",
        "--profile-interval", "1",
        "--json",
    ]  # fmt: skip
    for key, value in TASK_OPTIONS.items():
        args += ["--task-option", f"{key}={value}"]
    return args


def _short_ids(logs: list[Path]) -> list[str]:
    """Each peer's dashboard name from its log: the hex of its libp2p id's key, decoded here
    with hivemind's PeerID; the log's own rendering of it must agree."""
    names = []
    for log in logs:
        found = JOINED.search(log.read_text())
        if found is None:
            return []
        key_hex = PeerID.from_base58(found.group(1)).to_bytes()[-32:].hex()
        assert key_hex[:8] == found.group(2), found.group(0)
        names.append(key_hex[:8])
    return names


def _screen(view) -> str:
    console = Console(width=WIDTH, height=HEIGHT, record=True, color_system=None, file=_Null())
    console.print(render_dashboard(view, width=WIDTH, height=HEIGHT, footer="q quits"))
    return console.export_text()


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _complete(view) -> bool:
    """Both peers past epoch 1, each with a round record and a profile record made while it
    trained (the first one covers only the start: no samples)."""
    return len(view.peers) == 2 and all(
        p.epoch >= 1
        and p.rounds is not None
        and p.rounds.rounds
        and p.profile is not None
        and p.profile.samples_per_s > 0
        and p.samples_per_s > 0  # from the second progress record on
        for p in view.peers
    )


def _output(process: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The peer's stdout once it exited (killed with its group after ``timeout_s``)."""
    try:
        return process.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0]


def _wait_for_view(reader: ThreadedSwarmReader, processes, deadline_s: float):
    view = None
    while time.monotonic() < deadline_s:
        assert all(p.poll() is None for p in processes), "a peer ended early"
        view = reader.read()
        if _complete(view):
            return view
        time.sleep(1.0)
    raise AssertionError(f"no complete view in time; last: {view}")


def test_the_dashboard_shows_a_hivemind_swarm(tmp_path):
    start_s = time.monotonic()
    logs = [tmp_path / f"peer{i}.log" for i in range(2)]
    processes = []
    with HivemindBootstrap() as bootstrap:
        try:
            for seed, log in enumerate(logs, start=1):
                with log.open("w") as stderr:
                    processes.append(
                        subprocess.Popen(
                            _peer_args(bootstrap.address, seed),
                            stdout=subprocess.PIPE,
                            stderr=stderr,
                            text=True,
                            start_new_session=True,
                        )
                    )
            records = HivemindSwarmRecords(bootstrap.dht, RUN_ID, source=bootstrap.address)
            config = MonitorConfig(run_id=RUN_ID)
            deadline_s = start_s + 150
            names: list[str] = []
            while not names and time.monotonic() < deadline_s:
                time.sleep(0.5)
                names = _short_ids(logs)
            assert names, [log.read_text()[-2000:] for log in logs]
            reader = ThreadedSwarmReader(records, config, local_peer_id=None)
            try:
                view = _wait_for_view(reader, processes, deadline_s)
            finally:
                reader.close()
            local = next(p.peer_id for p in view.peers if p.peer_id.startswith(names[0]))
            local_reader = ThreadedSwarmReader(records, config, local_peer_id=local)
            try:
                local_view = local_reader.read()
            finally:
                local_reader.close()
            monitor = subprocess.run(
                [sys.executable, "-m", "peer", "monitor", "--backend", "hivemind",
                 "--initial-peers", bootstrap.address, "--run-id", RUN_ID, "--once"],
                capture_output=True, text=True, timeout=90,
                env={**os.environ, "COLUMNS": "100"},
            )  # fmt: skip
        finally:
            for process in processes:
                if process.poll() is None:
                    # the peer only (its group holds hivemind's processes, which it stops)
                    process.send_signal(signal.SIGTERM)  # `peer join` stops and reports
            outputs = [_output(process) for process in processes]
            leftovers = [name for p in processes for name in _left_behind(p.pid)]
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log.read_text()[-3000:]
    assert leftovers == []
    summaries = [json.loads(out.strip().splitlines()[-1]) for out in outputs]

    # the views: both peers, named as their logs name them, at epochs they really reached
    assert sorted(p.short_id for p in view.peers) == sorted(names)
    final_epoch = {name: s["epoch"] for name, s in zip(names, summaries, strict=True)}
    rate_of = {name: s["samples_per_s"] for name, s in zip(names, summaries, strict=True)}
    for peer in view.peers:
        assert 1 <= peer.epoch <= final_epoch[peer.short_id]
        assert peer.address.startswith("/ip4/127.0.0.1/tcp/") and not peer.stale
        # hivemind's own rate: an EMA of seconds per sample over its steps, which one stalled
        # step pulls far below the run's mean (CI saw 16 against 714 samples/s right after a
        # round that found no group); the run's mean counts the seconds a loaded host left the
        # peer waiting for a CPU, which the EMA of its steps does not (a full run saw 1,308
        # against a mean of 130); a unit mix-up (per ms, per step) would put it 1000x above
        assert 0 < peer.samples_per_s < 30 * rate_of[peer.short_id], (peer, summaries)
        fractions = peer.profile.fractions
        # the profile record's phases: every second of the window in one phase
        assert math.isclose(sum(fractions.values()), 1.0, abs_tol=0.02), fractions
        assert fractions["forward"] + fractions["backward"] > 0
        assert peer.profile.backend == "hivemind"
        log = peer.rounds
        assert log.target_batch_size == TARGET_BATCH
        assert 1 <= len(log.rounds) <= log.num_rounds <= final_epoch[peer.short_id]
        for entry in log.rounds:
            assert entry.epoch < log.epoch and entry.status in ("ok", "alone", "failed")
    assert view.target_batch_size == TARGET_BATCH  # read from the peers' round records
    assert view.rounds and view.verdict is not None and view.verdict.num_profiled == 2

    # what a viewer reads: both peers' rows, the rounds, the swarm's bottleneck, this peer's phases
    screen = _screen(local_view)
    assert f"run {RUN_ID}" in screen and "2 peers" in screen, screen
    for name in names:
        assert re.search(rf"^\*?{name} +/ip4/127\.0\.0\.1/tcp/", screen, re.MULTILINE), screen
    rounds = re.findall(r"^ +(\d+) +(?:alone|[12]/2 )", screen, re.MULTILINE)
    assert rounds and all(int(epoch) < max(final_epoch.values()) for epoch in rounds), screen
    assert re.search(r"bottleneck \w+ \(\d/2 peers\)", screen), screen
    assert re.search(rf"this peer {names[0]}", screen), screen
    assert re.search(r"forward +█*·* +\d+%", screen), screen

    # the same swarm through `peer monitor --backend hivemind --once` (a client-mode hivemind.DHT)
    assert monitor.returncode == 0, monitor.stderr[-2000:]
    assert "Traceback" not in monitor.stderr
    for name in names:
        assert re.search(rf"^{name} ", monitor.stdout, re.MULTILINE), monitor.stdout
    assert "2 peers" in monitor.stdout and "bottleneck" in monitor.stdout


# ---- on a terminal (tmux): `peer join --dashboard` and `peer demo` -------------------------------

TMUX_SIZE = ("-x", "100", "-y", "30")
PEER_ROW = re.compile(r"^(?P<star>\*?)(?P<id>[0-9a-f]{8}) +/ip4/127\.0\.0\.1/tcp/\S* +cpu +\d+ ")


def _tmux(tmp_path: Path) -> list[str]:
    return ["tmux", "-L", f"vp-hm-{tmp_path.name[-12:]}", "-f", "/dev/null"]


def _pane(tmux: list[str], session: str) -> str:
    return subprocess.run(
        [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, timeout=10
    ).stdout


def _wait_for_pane(tmux: list[str], session: str, ready, timeout_s: float, what: str) -> str:
    deadline_s = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline_s:
        text = _pane(tmux, session)
        if ready(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout_s:g} s:\n{text}")


def _rows(text: str) -> dict[str, bool]:
    """Peer id -> starred (this peer), for the peer rows on screen."""
    return {m["id"]: bool(m["star"]) for line in text.splitlines() if (m := PEER_ROW.match(line))}


def test_join_dashboard_shows_this_peer_in_a_hivemind_swarm(tmp_path):
    tmux = _tmux(tmp_path)
    logs = [tmp_path / "plain.log", tmp_path / "dashboard.log"]
    with HivemindBootstrap() as bootstrap:
        args = _peer_args(bootstrap.address, 1)
        with logs[0].open("w") as stderr:
            plain = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
            )
        command = shlex.join([*_peer_args(bootstrap.address, 2), "--dashboard"])
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "peer", *TMUX_SIZE,
             f"{command} 2>{shlex.quote(str(logs[1]))}; echo PEER-EXITED $?; sleep 600"],
            check=True, timeout=10,
        )  # fmt: skip
        try:

            def both_peers(text: str) -> bool:
                rows = _rows(text)
                return len(rows) == 2 and sum(rows.values()) == 1 and "phases data" in text

            screen = _wait_for_pane(tmux, "peer", both_peers, 150, "two peers on the dashboard")
            subprocess.run([*tmux, "send-keys", "-t", "peer", "q"], check=True, timeout=10)
            after = _wait_for_pane(tmux, "peer", lambda t: "PEER-EXITED" in t, 90, "the exit")
        finally:
            if plain.poll() is None:
                plain.send_signal(signal.SIGTERM)
            _output(plain)
            leftovers = _left_behind(plain.pid)
            subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
    assert plain.returncode == 0, logs[0].read_text()[-3000:]
    assert leftovers == []
    plain_name, local_name = _short_ids(logs)
    rows = _rows(screen)
    assert rows == {plain_name: False, local_name: True}, screen
    assert f"run {RUN_ID}" in screen and f"this peer {local_name}" in screen, screen
    # its ten phases in percent, from its profile record
    assert re.search(r"phases data \d+% h2d \d+% fwd \d+% bwd \d+% opt \d+%", screen), screen
    assert "PEER-EXITED 0" in after, after + logs[1].read_text()[-3000:]
    assert re.search(r"peer \S+: epoch \d+, \d+ steps", after), after


def test_hivemind_demo_shows_the_dashboard_and_q_ends_it_with_the_summary(tmp_path):
    tmux = _tmux(tmp_path)
    demo = [sys.executable, "-m", "peer", "demo", "--backend", "hivemind", "--peers", "2",
            "--seconds", "150", "--target-batch-size", str(TARGET_BATCH)]  # fmt: skip
    command = f"{shlex.join(demo)}; echo DEMO-EXITED $?; sleep 600"
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "demo", *TMUX_SIZE, command], check=True, timeout=10
    )
    try:

        def two_peers_and_rounds(text: str) -> bool:
            return len(_rows(text)) == 2 and re.search(r"^ +\d+ +(alone|\d/2) ", text, re.M)

        screen = _wait_for_pane(tmux, "demo", two_peers_and_rounds, 150, "the demo's swarm")
        assert "run demo" in screen and "2 peers" in screen and "q quits" in screen, screen
        assert re.search(r"[\d,]+/1,024 samples", screen), screen
        subprocess.run([*tmux, "send-keys", "-t", "demo", "q"], check=True, timeout=10)
        after = _wait_for_pane(tmux, "demo", lambda t: "DEMO-EXITED" in t, 90, "the demo's end")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
    assert "DEMO-EXITED 0" in after, after
    assert re.search(r"2/2 peers finished: \d+ rounds", after), after


def test_monitor_of_an_unreachable_hivemind_swarm_is_one_line_and_non_zero():
    unreachable = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEa3gXHYNNQZHyn69TwT9vp4BgMaYfuXzYaJpuoQdUw4W"
    done = subprocess.run(
        [sys.executable, "-m", "peer", "monitor", "--backend", "hivemind",
         "--initial-peers", unreachable, "--once"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode not in (0, 2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peer: error:") and unreachable in lines[0]
    assert done.stdout == ""
