"""The node side of the ``ray`` launcher: :class:`ProcessOwner`, the Ray actor that owns one
process of a configuration (the bootstrap node, a ``peer join`` or the baseline).

It runs in a Ray worker on the node its placement-group bundle put it on, and starts the
process with that worker's own Python (the venv ``ray start`` ran from), pinned with ``taskset``
and with ``OMP_NUM_THREADS`` = its torch threads. The process's stdout, stderr and metrics stream
are files in a node-local directory that the driver reads back by offset (:meth:`read`).

Nothing outlives its owner: the process stays in the worker's process group (Ray kills that
group when the worker ends: a normal end, ``ray.kill``, the driver's death; a child in a session
of its own would escape), ``setpriv --pdeathsig KILL`` makes the kernel kill it when the worker
dies any other way (SIGKILL), and a watchdog thread ends both when the node's raylet is gone
(the worker's parent changes: Ray leaves such a worker running).

This module imports no Ray at import time: the driver names the class, Ray runs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from experiments.launch.base import pinned

# The most bytes one read() hands back (a driver reads again until a short answer).
READ_CHUNK_BYTES = 4 * 1024 * 1024
KINDS = ("out", "log", "jsonl")
# How often the watchdog checks that the raylet (the worker's parent) is still there.
WATCHDOG_INTERVAL_S = 1.0


class ProcessOwner:
    """One process on this node; see the module docstring.

    Args:
        name: the process's name (``dht``, ``peer-<i>``, ``baseline``); names its files.
        work_dir: its configuration's directory for its files, under the node's temporary
            directory (created; :meth:`remove_files` deletes it).
    """

    def __init__(self, name: str, work_dir: str):
        self.name = name
        self.dir = Path(tempfile.gettempdir()) / "vp-ray" / work_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self._terminated = False
        self._stop = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch_raylet, args=(os.getppid(),), name="raylet-watchdog", daemon=True
        )
        self._watchdog.start()

    def _watch_raylet(self, raylet_pid: int) -> None:
        """SIGKILL the process and end this worker once the raylet that started it is gone."""
        while not self._stop.wait(WATCHDOG_INTERVAL_S):
            if os.getppid() != raylet_pid:
                if self.process is not None and self.process.poll() is None:
                    self.process.kill()
                os._exit(1)  # a worker without its raylet: nothing else would end it

    def where(self) -> dict[str, object]:
        """This node: Ray's node id, its address, host name, the CPU ids a process may use, and
        the directory of the process's files."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "node_cpus": sorted(os.sched_getaffinity(0)),
            "python": sys.executable,
            "files": str(self.dir),
        }

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        *,
        cpus: list[int] | None,
        threads: int,
        listen: tuple[str, str] | None,
        metrics: bool,
    ) -> int:
        """Start the process; its pid.

        Args:
            args: the interpreter's arguments (``["-m", "peer", "join", ...]``).
            env: extra environment variables.
            cpus: this node's CPU ids to pin it to (None: not pinned).
            threads: its torch threads (``OMP_NUM_THREADS``: Ray sets the worker's to its
                logical CPUs, 1 for a 0-CPU actor).
            listen: (interface to listen on, address to announce), None when it takes neither.
            metrics: whether it writes a metrics stream.
        """
        command = [sys.executable, *args]
        if listen is not None:
            command += ["--host", listen[0], "--announce-host", listen[1]]
        if metrics:
            command += ["--metrics-file", str(self.dir / f"{self.name}.jsonl")]
        command = pinned(command, cpus)
        if shutil.which("setpriv") is not None:
            command = ["setpriv", "--pdeathsig", "KILL", "--", *command]
        environment = os.environ | {"OMP_NUM_THREADS": str(threads)} | env
        with (
            (self.dir / f"{self.name}.out").open("ab") as out,
            (self.dir / f"{self.name}.log").open("ab") as log,
        ):
            # not start_new_session: Ray's cleanup of this worker's process group must reach it
            self.process = subprocess.Popen(
                command, stdout=out, stderr=log, stdin=subprocess.DEVNULL, env=environment
            )
        return self.process.pid

    def poll(self) -> int | None:
        """Its exit status, or None while it runs (or before it starts)."""
        return None if self.process is None else self.process.poll()

    def read(self, kind: str, offset: int) -> bytes:
        """Up to :data:`READ_CHUNK_BYTES` of ``<name>.<kind>`` from byte ``offset`` (b"" when
        there is nothing more, or no such file yet)."""
        if kind not in KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
        try:
            with (self.dir / f"{self.name}.{kind}").open("rb") as file:
                file.seek(offset)
                return file.read(READ_CHUNK_BYTES)
        except FileNotFoundError:
            return b""

    def terminate(self) -> None:
        """SIGTERM, once (a second could land in the interpreter's teardown)."""
        if self.poll() is None and self.process is not None and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.poll() is None and self.process is not None:
            self.process.kill()
            self.process.wait()

    def remove_files(self) -> None:
        """Stop the process if it still runs, then delete this process's files on the node."""
        self.kill()
        self._stop.set()
        for kind in KINDS:
            (self.dir / f"{self.name}.{kind}").unlink(missing_ok=True)
        for directory in (self.dir, self.dir.parent):  # once the last process's files are gone
            try:
                directory.rmdir()
            except OSError:
                break
