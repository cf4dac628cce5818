"""A worker script in a child process, driven over stdin/stdout, one JSON object a line.

The worker's first line is its hello (``peer_id``, ``address``); after that each line the test
sends is answered by one line. Test harnesses subclass :class:`JsonLinesChild` to add their own
commands.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def python_path(root: Path) -> str:
    """``PYTHONPATH`` for a child run from ``root``: the repository first, then what this
    process was given (packages installed beside the interpreter's own, as on a GPU image)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)


class JsonLinesChild:
    """A worker started with this interpreter and the checkout on its path.

    Args:
        worker: the script to run.
        spec: the first message it is sent (its configuration).
        stderr: where its log goes (inherited by default).
    """

    name = "child"

    def __init__(self, worker: Path, spec: dict[str, Any], *, stderr: IO[str] | None = None):
        env = {**os.environ, "PYTHONPATH": python_path(REPO_ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, str(worker)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
        )
        self.peer_id = ""
        self.address = ""
        self.send(spec)

    def send(self, message: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    async def receive(self, timeout_s: float) -> dict[str, Any]:
        """The next line, or RuntimeError if the worker exited (with :meth:`exit_detail`)."""
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), timeout_s)
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.process.poll()}{self.exit_detail()}")
        return json.loads(line)

    def exit_detail(self) -> str:
        return ""

    async def started(self, timeout_s: float = 60.0):
        hello = await self.receive(timeout_s)
        self.peer_id, self.address = hello["peer_id"], hello["address"]
        return self

    def kill(self) -> None:
        """SIGKILL it (if alive), reap it and close its pipes."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
