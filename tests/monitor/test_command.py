"""``peer monitor`` and ``peer join --dashboard`` as a user types them: help, bad input (one line,
exit 2) and an unreachable swarm (one line, non-zero)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(90)
PEER = [sys.executable, "-m", "peer"]
HIVEMIND_MONITOR = ["monitor", "--backend", "hivemind", "--initial-peers"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PEER, *args], capture_output=True, text=True, timeout=60)


def one_error_line(result: subprocess.CompletedProcess, needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peer") and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_help():
    result = run("monitor", "--help")
    assert result.returncode == 0
    assert "--initial-peers" in result.stdout and "--once" in result.stdout
    assert "--dashboard" in run("join", "--help").stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["monitor"], "--initial-peers"),
        (["monitor", "--initial-peers", "localhost"], "not a URL"),
        (["monitor", "--initial-peers", "http://127.0.0.1:1", "--interval", "0"], "--interval"),
        ([*HIVEMIND_MONITOR, "http://127.0.0.1:1"], "multiaddr"),
        ([*HIVEMIND_MONITOR, "/ip4/127.0.0.1/tcp/1", "--tls-ca", "ca.pem"], "--tls-ca"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    result = run(*args)
    assert result.returncode == 2
    one_error_line(result, needle)


def test_an_unreachable_swarm_is_one_line_and_non_zero():
    result = run("monitor", "--initial-peers", "http://127.0.0.1:1", "--once")
    assert result.returncode not in (0, 2)
    one_error_line(result, "http://127.0.0.1:1")
    assert result.stdout == ""
