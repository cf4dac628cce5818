"""The launcher interface: where and how a configuration's processes run.

A :class:`Launcher` opens one :class:`Session` per configuration (a context manager: closing it
stops every process it started and releases what it set up, also on errors and Ctrl-C). A
session starts the bootstrap node and the peers (or the baseline) from :class:`ProcessPlan`
objects, adding what depends on the place: the address to listen on, CPU pinning, the metrics
file's path. Process handles follow :class:`Handle`; every process's stdout and stderr end up
in the configuration's directory as ``<name>.out`` and ``<name>.log``, its metrics stream as
``<name>.jsonl``.
"""

from __future__ import annotations

import abc
import dataclasses
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

# Seconds a bootstrap node may take to print its URL on a loaded machine (imports included).
BOOTSTRAP_TIMEOUT_S = 60.0
POLL_S = 0.2


class LaunchError(RuntimeError):
    """A process could not be started or set up; the message says which and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessPlan:
    """A process to start.

    Attributes:
        name: ``dht``, ``peer-<i>`` or ``baseline``; names its files.
        args: the interpreter's arguments (``["-m", "peer", "join", ...]``), without the
            listening address and the metrics file, which the session adds.
        index: the peer index (its place in the network), None for others.
        cpus: CPU ids to pin it to (None: not pinned).
        env: extra environment variables.
        listens: whether it takes ``--host`` (and ``--announce-host``) arguments.
        metrics: whether it writes a metrics stream (``--metrics-file``).
    """

    name: str
    args: list[str]
    index: int | None = None
    cpus: list[int] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    listens: bool = True
    metrics: bool = True


class Handle(Protocol):
    """A started process."""

    name: str

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: peers finish the step, write a last metrics line); only the
        first call signals (a second SIGTERM could land in the interpreter's teardown)."""

    def kill(self) -> None:
        """Stop it now (SIGKILL)."""


class Session(abc.ABC):
    """One configuration's processes on a launcher; see the module docstring."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.handles: list[Handle] = []

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @abc.abstractmethod
    def start(self, plan: ProcessPlan) -> Handle:
        """Start ``plan``'s process."""

    def start_bootstrap(self, plan: ProcessPlan) -> str:
        """Start the bootstrap node; returns the address it prints on its first stdout line.

        Raises:
            LaunchError: it exited or printed nothing within :data:`BOOTSTRAP_TIMEOUT_S`.
        """
        handle = self.start(plan)
        out = self.run_dir / f"{plan.name}.out"
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while time.monotonic() < deadline:
            self.refresh(plan.name, "out")
            lines = out.read_text(errors="replace").splitlines() if out.exists() else []
            if lines and lines[0].strip():
                return lines[0].strip()
            if handle.poll() is not None:
                raise LaunchError(f"the bootstrap node exited ({handle.poll()}): {self.tail(plan)}")
            time.sleep(POLL_S)
        raise LaunchError(f"the bootstrap node printed no address in {BOOTSTRAP_TIMEOUT_S:.0f} s")

    def network_entry(self) -> Callable[[], None] | None:
        """A function that moves the calling thread into the network the processes live in (a
        dashboard's thread, whose sockets must reach the peers); None: the host's network
        reaches them (or nothing here can)."""
        return None

    def refresh(self, name: str, kind: str = "jsonl") -> None:  # noqa: B027 (optional hook)
        """Bring ``<name>.<kind>`` up to date in the run directory (remote sessions copy it)."""

    def collect(self) -> None:  # noqa: B027 (optional hook)
        """Bring every file of the configuration into the run directory."""

    def tail(self, plan: ProcessPlan, num_lines: int = 3) -> str:
        """The last lines of a process's log, for error messages."""
        self.refresh(plan.name, "log")
        log = self.run_dir / f"{plan.name}.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return " | ".join(lines[-num_lines:]) or "(no output)"

    def stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process still running, then SIGKILL those left after ``grace_s``."""
        running = [h for h in self.handles if h.poll() is None]
        for handle in running:
            handle.terminate()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(h.poll() is None for h in running):
            time.sleep(POLL_S)
        for handle in running:
            if handle.poll() is None:
                handle.kill()

    def close(self) -> None:
        """Stop everything; safe twice."""
        self.stop_all(grace_s=5.0)


class Launcher(abc.ABC):
    """Opens a session per configuration; a context manager over the whole sweep."""

    name = "launcher"

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check(self) -> None:  # noqa: B027 (optional hook)
        """Raise :class:`LaunchError` if this launcher cannot run here (before anything starts)."""

    @abc.abstractmethod
    def open_session(self, run_dir: Path, num_peers: int) -> Session:
        """A session for a configuration of ``num_peers`` peers (0 for the baseline)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the launcher holds across configurations; safe twice."""


class PopenHandle:
    """A local child process whose output goes to files; see :class:`Handle`."""

    def __init__(self, name: str, command: list[str], run_dir: Path, env: dict[str, str]):
        self.name = name
        self._terminated = False
        with (
            (run_dir / f"{name}.out").open("ab") as out,
            (run_dir / f"{name}.log").open("ab") as log,
        ):
            # its own session: a Ctrl-C at the terminal reaches the sweep, which stops it
            self.process = subprocess.Popen(
                command, stdout=out, stderr=log, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip

    def poll(self) -> int | None:
        return self.process.poll()

    def terminate(self) -> None:
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.process.terminate()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def pinned(command: list[str], cpus: list[int] | None) -> list[str]:
    """``command`` run under ``taskset`` on ``cpus`` (unchanged when None).

    Raises:
        LaunchError: pinning asked for but ``taskset`` is missing.
    """
    if cpus is None:
        return command
    if shutil.which("taskset") is None:
        raise LaunchError("pinning CPUs needs taskset (util-linux), or resources.pin_cpus = false")
    return ["taskset", "-c", ",".join(map(str, cpus)), *command]


def python() -> str:
    return sys.executable
