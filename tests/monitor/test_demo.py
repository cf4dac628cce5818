"""``peer demo`` on a terminal (tmux): the live dashboard of its swarm, q stops the peers early,
the terminal comes back and the demo still ends with its summary."""

from __future__ import annotations

import re
import shlex
import subprocess
import uuid

import pytest

from tests.monitor.test_swarm import PEER, ROOT, SIZE, peer_rows, wait_for

pytestmark = pytest.mark.timeout(180)


def test_demo_shows_the_dashboard_and_q_ends_it_with_the_summary():
    tmux = ["tmux", "-L", f"vp-demo-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
    demo = [*PEER, "demo", "--peers", "2", "--seconds", "120", "--target-batch-size", "512"]
    command = f"cd {shlex.quote(str(ROOT))} && {shlex.join(demo)}; echo DEMO-EXITED $?; sleep 600"
    subprocess.run([*tmux, "new-session", "-d", "-s", "demo", *SIZE, command], check=True)

    def pane() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "demo"], capture_output=True, text=True, timeout=10
        ).stdout

    try:

        def averaging() -> str:
            text = pane()
            rounds = re.search(r"^ +\d+ +2/2 ", text, re.MULTILINE)
            return text if len(peer_rows(text)) == 2 and rounds else ""

        screen = wait_for(averaging, 120, "two peers averaging on the demo's dashboard")
        assert "run demo" in screen and "2 peers" in screen and "q quits" in screen
        assert re.search(r"[\d,]+/512 samples", screen), screen
        subprocess.run([*tmux, "send-keys", "-t", "demo", "q"], check=True, timeout=10)
        after = wait_for(lambda: "DEMO-EXITED" in (t := pane()) and t, 90, "the demo's end")
        assert "DEMO-EXITED 0" in after, after
        assert re.search(r"2/2 peers finished: \d+ rounds", after), after
        assert "run demo ·" not in after  # the alternate screen is gone
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
