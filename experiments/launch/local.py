"""The ``local`` launcher: every process on this machine, on loopback (127.0.0.1)."""

from __future__ import annotations

import os
from pathlib import Path

from experiments.launch.base import Launcher, PopenHandle, ProcessPlan, Session, pinned, python

LOOPBACK = "127.0.0.1"


class LocalSession(Session):
    """Processes on loopback; their files are written straight into the run directory."""

    def start(self, plan: ProcessPlan) -> PopenHandle:
        command = [python(), *plan.args]
        if plan.listens:
            command += ["--host", LOOPBACK]
        if plan.metrics:
            command += ["--metrics-file", str(self.run_dir / f"{plan.name}.jsonl")]
        handle = PopenHandle(
            plan.name, pinned(command, plan.cpus), self.run_dir, os.environ | plan.env
        )
        self.handles.append(handle)
        return handle


class LocalLauncher(Launcher):
    """See the module docstring."""

    name = "local"

    def open_session(self, run_dir: Path, num_peers: int) -> LocalSession:
        return LocalSession(run_dir)
