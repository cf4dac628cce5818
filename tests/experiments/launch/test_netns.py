"""The netns launcher: shaped links, and no namespace left behind after a run, a SIGTERM or a
SIGKILL of the sweep. Needs root and iproute2 (``ip``, ``tc``); CI runs as root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from experiments.launch.netns import (
    NetnsSession,
    address_of,
    cleanup_all,
    delete_namespace,
    list_namespaces,
)
from experiments.spec import NetworkSpec
from tests.experiments.helpers import ROOT, peer_cli, tiny_spec

pytestmark = pytest.mark.timeout(240)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} missing (install iproute2)"
    # one name per process: pytest-xdist's workers collect this module at the same moment
    probe = f"vpx-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    delete_namespace(probe)
    if done.returncode != 0:
        return f"cannot create network namespaces here: {done.stderr.strip()}"
    return None


REASON = _why_not()
if REASON is not None:
    pytestmark = [pytestmark, pytest.mark.skip(reason=REASON)]


@pytest.fixture
def namespaces_cleaned():
    """Whatever namespace a test leaves behind (it should leave none) is deleted after it."""
    before = set(list_namespaces())
    yield before
    for name in set(list_namespaces()) - before:
        delete_namespace(name)


def test_a_link_shaped_to_20_mbit_carries_at_most_22(tmp_path: Path, namespaces_cleaned):
    prefix = f"vpx-t{os.getpid()}"
    with NetnsSession(tmp_path, prefix, 2, NetworkSpec(bandwidth_mbit=20)) as session:
        assert set(list_namespaces(prefix)) == {f"{prefix}-hub", f"{prefix}-p0", f"{prefix}-p1"}
        exec_in = ["ip", "netns", "exec"]
        server = subprocess.Popen(
            [*exec_in, session.namespaces[1], sys.executable, "-m",
             "tests.experiments.launch.transfer", "serve", "5001", "4"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"
            subprocess.run(
                [*exec_in, session.namespaces[0], sys.executable, "-m",
                 "tests.experiments.launch.transfer", "send", address_of(1), "5001", "6"],
                cwd=ROOT, timeout=60, check=True,
            )  # fmt: skip
            measured = json.loads(server.stdout.readline())
        finally:
            server.kill()
            server.wait()
    mbit_per_s = 8 * measured["bytes"] / measured["seconds"] / 1e6
    assert measured["bytes"] > 0
    assert mbit_per_s <= 22.0, measured
    assert list_namespaces(prefix) == []


def _net_spec(tmp_path: Path, seconds: float) -> Path:
    spec = tmp_path / "spec.toml"
    text = tiny_spec(
        "net", launcher="netns", extra="baseline = false\n", stop=f"max_time_s = {seconds}"
    )
    spec.write_text(text + "\n[network]\nbandwidth_mbit = 50\n")
    return spec


def test_a_sweep_in_namespaces_runs_and_leaves_nothing(tmp_path: Path, namespaces_cleaned):
    out = tmp_path / "out"
    result = peer_cli("experiment", "run", str(_net_spec(tmp_path, 3)), "--out", str(out),
                      timeout_s=180)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads((out / "swarm_seed-0" / "status.json").read_text())
    assert status["status"] == "done"
    # peers listened on their namespace's address, and their metrics came back
    log = (out / "swarm_seed-0" / "peer-1.log").read_text()
    assert f"serving on http://{address_of(1)}:" in log
    assert (out / "swarm_seed-0" / "peer-0.jsonl").stat().st_size > 0
    assert set(list_namespaces()) == namespaces_cleaned


def _processes_of(out: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(out) in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_sweep_leaves_no_namespace(tmp_path: Path, namespaces_cleaned, sig):
    out = tmp_path / "out"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "peer", "experiment", "run", str(_net_spec(tmp_path, 60)),
         "--out", str(out)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not list(out.glob("*/peer-1.jsonl")):  # the peers are training
            assert time.monotonic() < deadline and sweep.poll() is None, sweep.stderr.read()
            time.sleep(0.2)
        created = set(list_namespaces()) - namespaces_cleaned
        assert len(created) == 3  # the hub and two peers
        sweep.send_signal(sig)
        sweep.wait(timeout=60)
        deadline = time.monotonic() + 30
        while set(list_namespaces()) & created or _processes_of(out):
            assert time.monotonic() < deadline, (list_namespaces(), _processes_of(out))
            time.sleep(0.2)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        for name in set(list_namespaces()) - namespaces_cleaned:
            cleanup_all(name)
    assert sweep.returncode != 0


def test_cleanup_command_removes_left_namespaces(namespaces_cleaned):
    prefix = f"vpx-c{os.getpid()}"
    session = NetnsSession(Path("/tmp"), prefix, 1, NetworkSpec())
    session._closed = True  # as if this process had died: nothing deletes them on close
    assert len(list_namespaces(prefix)) == 2
    result = peer_cli("experiment", "cleanup", timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert f"{prefix}-hub" in result.stdout
    assert list_namespaces(prefix) == []


def test_latency_without_netem_goes_to_the_user_space_emulator(namespaces_cleaned):
    from experiments.launch.base import LaunchError
    from experiments.launch.netns import NetnsLauncher, netem_available

    auto = NetnsLauncher(NetworkSpec(latency_ms=10))
    auto.check()
    assert auto.emulator == ("tc" if netem_available() else "linkemu")
    kernel_only = NetnsLauncher(NetworkSpec(latency_ms=10, emulator="tc"))
    if netem_available():
        kernel_only.check()
    else:
        with pytest.raises(LaunchError, match="sch_netem"):
            kernel_only.check()
    NetnsLauncher(NetworkSpec(bandwidth_mbit=10)).check()  # tbf alone needs no netem
    assert set(list_namespaces()) == namespaces_cleaned
