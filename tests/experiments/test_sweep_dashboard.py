"""``peer experiment run`` on a terminal (tmux, 100x30): the running configuration's live
dashboard shows its peers training; q puts the progress bar back and the sweep completes;
Ctrl-C stops the sweep, its processes and the dashboard, and gives the terminal back."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.experiments.helpers import ROOT, tiny_spec

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (a terminal to draw on)"),
]
COLUMNS, LINES = 100, 30
# a peer's row: id, address, device (cpu, or cuda where a GPU is), epoch (monitor/render.py)
PEER_ROW = re.compile(r"^\*?[0-9a-f]{8} +127\.0\.0\.1:\d+ +\S+ +(?P<epoch>\d+)", re.MULTILINE)
CONFIG = "swarm_seed-0"


def wait_for(predicate: Callable[[], str], timeout_s: float, what: str) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


class Terminal:
    """A tmux server of its own running one command in a fixed-size window."""

    def __init__(self, command: str):
        self.tmux = ["tmux", "-L", f"vp-sweep-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
        size = ["-x", str(COLUMNS), "-y", str(LINES)]
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "s", *size, command], check=True)

    def screen(self) -> str:
        return subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", "s"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "s", *keys], check=True, timeout=10)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def sweep(tmp_path: Path) -> Iterator[Callable[[float], tuple[Terminal, str, Path]]]:
    """Starts a one-configuration sweep (two peers) training for the given seconds."""
    terminals = []

    def start(seconds: float) -> tuple[Terminal, str, Path]:
        name = f"dash{uuid.uuid4().hex[:6]}"
        spec, out = tmp_path / "spec.toml", tmp_path / "out"
        spec.write_text(tiny_spec(name, extra="baseline = false", stop=f"max_time_s = {seconds}"))
        command = [sys.executable, "-m", "peer", "experiment", "run", str(spec), "--out", str(out)]
        line = f"cd {shlex.quote(str(ROOT))} && {shlex.join(command)}; echo SWEEP-EXITED $?; "
        terminals.append(Terminal(line + "sleep 600"))
        return terminals[-1], name, out

    yield start
    for terminal in terminals:
        terminal.close()


def _training(terminal: Terminal, name: str) -> str:
    """The dashboard of the configuration, once both peers show an epoch past the first."""

    def shown() -> str:
        text = terminal.screen()
        epochs = [int(m["epoch"]) for m in PEER_ROW.finditer(text)]
        header = f"run {name}-{CONFIG}" in text and "2 peers" in text
        # a whole frame: read while the dashboard redraws, the screen can hold the top of the
        # new frame and not yet its footer (seen once under a loaded make test)
        footer = "q quits" in text
        return text if header and footer and len(epochs) == 2 and min(epochs) >= 1 else ""

    return wait_for(shown, 90, "both peers training on the sweep's dashboard")


def _sweep_and_children(out: Path) -> list[psutil.Process]:
    """The sweep's process (not the shell around it) and every process it started."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline[:1] == [sys.executable] and "experiment" in cmdline and str(out) in cmdline:
            return [process, *process.children(recursive=True)]
    return []


def test_the_dashboard_shows_the_running_configuration_and_q_gives_the_bar_back(sweep):
    terminal, name, out = sweep(10)
    screen = _training(terminal, name)
    assert f"config 1/1: {CONFIG}" in screen and "q quits" in screen  # the footer
    assert re.search(r"\d+/256 samples", screen), screen
    terminal.keys("q")
    wait_for(
        lambda: "dashboard closed (q)" in (t := terminal.screen()) and "q quits" not in t,
        20,
        "the progress bar back after q",
    )
    end = wait_for(lambda: "SWEEP-EXITED" in (t := terminal.screen()) and t, 90, "the sweep's end")
    assert "SWEEP-EXITED 0" in end, end
    assert f"{CONFIG}: done in" in end and "report: " in end
    status = json.loads((out / CONFIG / "status.json").read_text())
    assert status["status"] == "done", status
    assert sorted(p.name for p in (out / CONFIG).glob("peer-*.jsonl")) == [
        "peer-0.jsonl",
        "peer-1.jsonl",
    ]
    assert (out / "report.md").is_file()


def test_ctrl_c_in_the_dashboard_stops_the_sweep_and_its_processes(sweep):
    terminal, name, out = sweep(120)
    _training(terminal, name)
    processes = _sweep_and_children(out)
    assert len(processes) >= 4  # the sweep, the bootstrap node, two peers
    terminal.keys("C-c")
    end = wait_for(lambda: "SWEEP-EXITED" in (t := terminal.screen()) and t, 60, "the sweep's end")
    assert "SWEEP-EXITED 130" in end, end
    assert "q quits" not in end and f"run {name}" not in end  # the terminal is given back
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, alive
    assert not (out / CONFIG / "status.json").exists()  # interrupted, not finished
