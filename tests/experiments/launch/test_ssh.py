"""The ssh launcher against a real sshd on 127.0.0.1: peers start over SSH, train, stop, and
their metrics streams come back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.experiments.helpers import peer_cli, read_lines, tiny_spec
from tests.experiments.launch.sshd import Sshd, why_not

pytestmark = pytest.mark.timeout(240)
REASON = why_not()
if REASON is not None:
    pytestmark = [pytestmark, pytest.mark.skip(reason=REASON)]


@pytest.fixture
def sshd(tmp_path: Path):
    server = Sshd(tmp_path / "sshd")
    yield server
    server.close()


def _inventory(sshd: Sshd, workdir: Path) -> str:
    host = f"""
[[ssh.hosts]]
host = "127.0.0.1"
user = "{sshd.user}"
port = {sshd.port}
key = "{sshd.client_key}"
python = "{sys.executable}"
workdir = "{workdir}"
listen_host = "127.0.0.1"
ssh_options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]
"""
    return host


def test_peers_run_over_ssh_and_their_metrics_come_back(tmp_path: Path, sshd: Sshd):
    remote = tmp_path / "remote"
    spec = tmp_path / "spec.toml"
    spec.write_text(
        tiny_spec("viassh", launcher="ssh", extra="baseline = true\n", stop="max_time_s = 3")
        + _inventory(sshd, remote)
    )
    out = tmp_path / "out"
    result = peer_cli("experiment", "run", str(spec), "--out", str(out), timeout_s=200)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, files in (("swarm_seed-0", ["peer-0", "peer-1"]), ("baseline_seed-0", ["baseline"])):
        status = json.loads((out / name / "status.json").read_text())
        assert status["status"] == "done", status
        for stem in files:
            local = read_lines(out / name / f"{stem}.jsonl")
            # the copy is the host's file, line for line
            assert local == read_lines(remote / "out" / name / f"{stem}.jsonl")
            assert local and sum(line["samples"] for line in local) > 0
    # the peers were started by the remote shell: their logs came back over ssh
    log = (out / "swarm_seed-0" / "peer-0.log").read_text()
    assert "serving on http://127.0.0.1:" in log
    summary = (out / "swarm_seed-0" / "peer-0.out").read_text().splitlines()[-1]
    assert json.loads(summary)["num_samples"] > 0
    assert (out / "report.md").exists()


def test_unreachable_host_is_refused_before_anything_starts(tmp_path: Path, sshd: Sshd):
    spec = tmp_path / "spec.toml"
    text = _inventory(sshd, tmp_path / "remote").replace(f"port = {sshd.port}", "port = 1")
    spec.write_text(tiny_spec("nossh", launcher="ssh", stop="max_time_s = 3") + text)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = peer_cli("experiment", "run", str(spec), "--out", str(tmp_path / "out"),
                      timeout_s=60, env={**os.environ, "TMPDIR": str(scratch)})  # fmt: skip
    assert result.returncode == 1
    assert "cannot connect" in result.stderr
    assert not list((tmp_path / "out").glob("*/status.json"))
    # the launcher's ssh control directory went with it
    assert list(scratch.iterdir()) == []
