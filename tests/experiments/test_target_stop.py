"""The target-loss rule stops a process with SIGTERM; one that ends by that signal (as the
baseline with loader workers can, in interpreter teardown) is stopped, not failed; one that
dies of anything else still fails the configuration."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from experiments.launch.base import ProcessPlan
from experiments.launch.local import LocalSession
from experiments.runner import watch
from experiments.spec import parse_spec
from peer.records.profile import PROFILE_PHASES

pytestmark = pytest.mark.timeout(60)
LINE = {
    "t": 1.0, "peer": "p", "run": "r", "epoch": 1, "step": 1, "loss": 0.1, "samples": 32,
    "samples_per_s": 32.0, "phases": dict.fromkeys(PROFILE_PHASES, 0.25),
    "net": {"sent": 0, "recv": 0}, "cpu_percent": 100.0, "rss_bytes": 1,
}  # fmt: skip


def script(on_sigterm: str) -> str:
    """Writes one metrics line below the target, then sleeps; ``on_sigterm`` is ``default``
    (dies of the signal) or an exit status."""
    handler = (
        ""
        if on_sigterm == "default"
        else (f"signal.signal(signal.SIGTERM, lambda *_: sys.exit({on_sigterm}))")
    )
    return textwrap.dedent(f"""
        import json, signal, sys, time
        {handler}
        path = sys.argv[sys.argv.index("--metrics-file") + 1]
        with open(path, "w") as file:
            file.write(json.dumps({LINE!r}) + "\\n")
        time.sleep(50)
    """)


@pytest.mark.parametrize(("on_sigterm", "status"), [("default", "done"), ("3", "failed")])
def test_a_process_ended_by_the_target_rules_sigterm_is_stopped(tmp_path: Path, on_sigterm, status):
    spec = parse_spec({"stop": {"max_time_s": 60, "target_loss": 0.5, "timeout_s": 40}})
    plan = ProcessPlan(name="baseline", args=["-c", script(on_sigterm)], listens=False)
    with LocalSession(tmp_path) as session:
        session.start(plan)
        outcome = watch(spec, session, [plan])
    assert outcome.stopped_by == "target_loss"
    assert outcome.status == status, outcome
    assert json.loads((tmp_path / "baseline.jsonl").read_text())["loss"] == 0.1
