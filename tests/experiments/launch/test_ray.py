"""The ray launcher: a 3-peer sweep with a baseline on a Ray cluster of 3 nodes on this machine.

The cluster and the sweep run in a network namespace of their own with only loopback up, so
that Ray advertises 127.0.0.1 (it would advertise the machine's routable address otherwise) and
no test traffic leaves loopback. Ray is a test dependency (``make test`` installs
``volunteer-peer[ray]``); the module is skipped only where a namespace cannot be made.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.analysis import PLACEMENT_FILE
from experiments.report.writer import write_report
from tests.experiments.helpers import ROOT, tiny_spec
from tests.experiments.test_local_sweep import summary_rows
from tests.helpers.child import python_path

pytestmark = pytest.mark.timeout(480)

REASON = "needs root and iproute2 to make a network namespace for the test's Ray cluster"
if shutil.which("ip") is None or os.geteuid() != 0:
    pytestmark = [pytestmark, pytest.mark.skip(reason=REASON)]

CLUSTER_START_S = 120.0  # three nodes on a loaded 2-core machine


def _env() -> dict[str, str]:
    """This checkout first on the path: the cluster's workers and the peers import it too (and
    the console wide enough that a line is not wrapped)."""
    env = {"PYTHONPATH": python_path(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "COLUMNS": "300"}
    return os.environ | env


def sweep_processes(namespace: str) -> dict[int, str]:
    """pid -> command line of every process of a sweep (bootstrap, peers, baseline, the driver)
    in the namespace."""
    found = {}
    for pid in subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    ).stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # ended meanwhile
        ours = "peer" in argv and ({"join", "dht", "experiment"} & set(argv))
        if ours or "peer.bench.baseline_run" in argv:
            found[int(pid)] = " ".join(argv)
    return found


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    name = f"vpr-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():  # whatever the test's cluster left: only ours live here
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.fixture(scope="module")
def cluster(namespace: str, tmp_path_factory) -> Iterator[dict]:
    """The cluster's address and node ids (the helper stops it when its stdin closes)."""
    log = (tmp_path_factory.mktemp("ray") / "cluster.log").open("wb")
    helper = subprocess.Popen(
        ["ip", "netns", "exec", namespace,
         sys.executable, "-m", "tests.experiments.launch.ray_cluster"],
        cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
    )  # fmt: skip
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(helper.stdout, selectors.EVENT_READ)
            ready = selector.select(timeout=CLUSTER_START_S)
        line = helper.stdout.readline() if ready else b""
        assert line, f"the test's Ray cluster did not start (exit {helper.poll()}), see {log.name}"
        yield json.loads(line)
    finally:
        helper.stdin.close()
        try:
            helper.wait(timeout=60)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
        log.close()


def ray_spec(address: str, *, stop: str = "max_time_s = 4", extra: str = "") -> str:
    """A tiny spec of 3 peers on 3 CPUs for the test's cluster."""
    ray_table = f'[ray]\naddress = "{address}"\nready_timeout_s = 60\n'
    spec = tiny_spec("ray", launcher="ray", extra=extra + ray_table, stop=stop)
    spec = spec.replace("peers = 2", "peers = 3").replace("total_cpus = 2", "total_cpus = 3")
    # three peers started through Ray's workers took over 90 s in the parallel part of the suite
    # (they trained 4 s): the bound is on a configuration, start included
    return spec.replace("timeout_s = 90", "timeout_s = 200")


def run_in(namespace: str, *args: str, **kwargs) -> subprocess.Popen:
    """``peer ARGS`` in the namespace, as a user on a cluster node runs it."""
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-m", "peer", *args],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def headings(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith("#")]


def test_a_sweep_runs_on_distinct_nodes_and_leaves_nothing(
    namespace: str, cluster: dict, tmp_path: Path
):
    spec = tmp_path / "spec.toml"
    spec.write_text(ray_spec(cluster["address"]))
    out = tmp_path / "out"
    sweep = run_in(namespace, "experiment", "run", str(spec), "--out", str(out))
    _, stderr = sweep.communicate(timeout=360)
    assert sweep.returncode == 0, stderr[-3000:]
    assert not sweep_processes(namespace), "processes of the sweep outlived it"
    for config in ("baseline_seed-0", "swarm_seed-0"):
        assert json.loads((out / config / "status.json").read_text())["status"] == "done"
    assert sorted(p.name for p in (out / "swarm_seed-0").glob("*.jsonl")) == [
        f"peer-{i}.jsonl" for i in range(3)
    ]
    assert (out / "swarm_seed-0" / "peer-0.log").stat().st_size > 0

    placed = json.loads((out / "swarm_seed-0" / PLACEMENT_FILE).read_text())
    nodes = {p["name"]: p["node_id"] for p in placed}
    assert set(nodes) == {"dht", "peer-0", "peer-1", "peer-2"}
    peers_nodes = [nodes[f"peer-{i}"] for i in range(3)]
    assert sorted(peers_nodes) == sorted(cluster["nodes"])  # one peer per node
    assert all(p["address"] == "127.0.0.1" for p in placed)
    baseline = json.loads((out / "baseline_seed-0" / PLACEMENT_FILE).read_text())
    assert baseline[0]["node_id"] == cluster["nodes"][0]  # the only node with 3 CPUs

    report = (out / "report.md").read_text()
    rows = summary_rows(report)
    assert set(rows) == {"baseline_seed-0", "swarm_seed-0"}
    assert rows["swarm_seed-0"]["peers"] == "3" and int(rows["swarm_seed-0"]["samples"]) > 0
    placement = report.split("## Where each process ran", 1)[1]
    assert all(node in placement for node in peers_nodes)
    # the same report as the local launcher's, plus where each process ran
    local = tmp_path / "as-local"
    shutil.copytree(out, local)
    for path in local.glob(f"*/{PLACEMENT_FILE}"):
        path.unlink()
    local_report = write_report(local).read_text()
    assert [h for h in headings(report) if h != "## Where each process ran"] == headings(
        local_report
    )
    assert summary_rows(local_report) == rows


def test_a_placement_the_cluster_cannot_satisfy_is_one_line(
    namespace: str, cluster: dict, tmp_path: Path
):
    spec = tmp_path / "spec.toml"
    text = ray_spec(cluster["address"], extra="baseline = false\n")
    # two peers of 3 CPUs each: only the head node has 3
    text = text.replace("peers = 3", "peers = 2").replace("total_cpus = 3", "total_cpus = 6")
    spec.write_text(text.replace("ready_timeout_s = 60", "ready_timeout_s = 2"))
    sweep = run_in(namespace, "experiment", "run", str(spec), "--out", str(tmp_path / "out"))
    _, stderr = sweep.communicate(timeout=120)
    assert sweep.returncode == 1
    failed = [line for line in stderr.splitlines() if "failed" in line]
    assert len(failed) == 1, stderr[-2000:]
    reason = json.loads((tmp_path / "out" / "swarm_seed-0" / "status.json").read_text())["reason"]
    assert failed[0] == f"swarm_seed-0: failed: {reason}"
    assert reason.startswith("resources.total_cpus: the Ray cluster did not place bundles of 3, 3")
    assert "within ray.ready_timeout_s = 2 s" in reason


def _wait_gone(namespace: str, pids: set[int], timeout_s: float = 60) -> set[int]:
    """Those of ``pids`` still running in the namespace after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := pids & set(sweep_processes(namespace))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_a_dead_actor_a_lost_node_and_a_killed_sweep_leave_nothing(
    namespace: str, cluster: dict, tmp_path: Path
):
    """Runs last: it kills one of the cluster's nodes."""
    spec = tmp_path / "spec.toml"
    spec.write_text(
        ray_spec(cluster["address"], stop="max_time_s = 120", extra="baseline = false\n")
    )
    out = tmp_path / "out"
    sweep = run_in(namespace, "experiment", "run", str(spec), "--out", str(out))
    placement = out / "swarm_seed-0" / PLACEMENT_FILE
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sweep.poll() is None:
        placed = json.loads(placement.read_text()) if placement.exists() else []
        if len(placed) == 4:
            break
        time.sleep(0.5)
    pids = {p["name"]: p["pid"] for p in placed}
    assert len(pids) == 4, f"the sweep did not start its processes: {sweep.poll()}"
    # the victims: peers on worker nodes (the head's raylet serves the cluster and the driver)
    on_workers = [p["name"] for p in placed if p["node_id"] != cluster["nodes"][0]]
    assert len(on_workers) == 2, placed
    try:
        os.kill(_parent(pids[on_workers[0]]), signal.SIGKILL)  # a dead actor ...
        assert not _wait_gone(namespace, {pids[on_workers[0]]}), "a peer outlived its actor"
        os.kill(_parent(_parent(pids[on_workers[1]])), signal.SIGKILL)  # ... a lost node ...
        assert not _wait_gone(namespace, {pids[on_workers[1]]}), "a peer outlived its node"
    finally:
        sweep.send_signal(signal.SIGKILL)  # ... and a SIGKILLed sweep
        sweep.communicate(timeout=30)
    assert not _wait_gone(namespace, set(pids.values())), "processes outlived the sweep"
    # what a killed sweep does leave: its processes' files, under the nodes' temporary directory
    shutil.rmtree(Path(placed[0]["files"]).parent)


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])


def test_without_ray_the_launcher_is_one_clear_line(tmp_path: Path):
    spec = tmp_path / "spec.toml"
    spec.write_text(ray_spec("auto"))
    code = (
        "import sys; sys.modules['ray'] = None; from peer.cli.main import main; "
        f"sys.exit(main(['experiment', 'run', {str(spec)!r}, '--out', {str(tmp_path / 'o')!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "peer: error: launcher = 'ray' needs Ray, which is not installed: "
        "pip install 'volunteer-peer[ray]'"
    )
