"""Starting and stopping one emulated link's forwarder process.

:class:`EmulatedLink` runs :mod:`experiments.linkemu.forwarder` for two endpoints (a namespace and
a device name each) and waits until it holds both TAP devices; the caller then gives them
addresses, bridges them and brings them up as it would a veth pair. Closing it stops the
forwarder, which takes the devices with it. If the launcher dies, the forwarder sees EOF on its
stdin and exits too, so no forwarder outlives the sweep that started it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from experiments.linkemu.shaper import LinkShape

# Seconds the forwarder may take to import and open its devices on a loaded machine.
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class LinkEmuError(RuntimeError):
    """The forwarder could not start (the message holds its last stderr lines)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Endpoint:
    """One side of an emulated link.

    Attributes:
        ifname: the TAP device's name (e.g. ``eth0``).
        netns: the named network namespace it is created in (None: the caller's).
    """

    ifname: str
    netns: str | None = None


class EmulatedLink:
    """A running forwarder between ``a`` and ``b``; a context manager, close safe twice.

    Args:
        a: one side (frames it sends are shaped by ``a_to_b``).
        b: the other side.
        a_to_b: the shape of the direction from ``a`` to ``b``.
        b_to_a: the shape of the other direction.
        log_file: where the forwarder's stderr goes (None: discarded).
        seed: seeds the loss and jitter draws (None: fresh randomness).

    Raises:
        LinkEmuError: it exited or did not get ready within :data:`READY_TIMEOUT_S`.
    """

    def __init__(
        self,
        a: Endpoint,
        b: Endpoint,
        *,
        a_to_b: LinkShape,
        b_to_a: LinkShape,
        log_file: Path | None = None,
        seed: int | None = None,
    ):
        self._stats_file = None if log_file is None else log_file.with_suffix(".stats.json")
        config: dict[str, Any] = {
            "a": dataclasses.asdict(a),
            "b": dataclasses.asdict(b),
            "a_to_b": dataclasses.asdict(a_to_b),
            "b_to_a": dataclasses.asdict(b_to_a),
            "seed": seed,
            "stats_file": None if self._stats_file is None else str(self._stats_file),
        }
        self._log_file = log_file
        stderr = subprocess.DEVNULL if log_file is None else log_file.open("ab")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "experiments.linkemu.forwarder", json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                start_new_session=True,  # a Ctrl-C reaches the launcher, which stops it in order
            )  # fmt: skip
        finally:
            if log_file is not None:
                stderr.close()
        self._closed = False
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        stdout = self.process.stdout
        while time.monotonic() < deadline_s:
            ready, _, _ = select.select([stdout], [], [], 0.2)
            if ready:
                line = stdout.readline()
                if line.strip() == b"ready":
                    return
                if not line:
                    break
        raise LinkEmuError(f"the link forwarder did not start: {self._log_tail()}")

    def _log_tail(self) -> str:
        if self._log_file is None or not self._log_file.exists():
            return f"exit status {self.process.poll()}"
        lines = self._log_file.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or f"exit status {self.process.poll()}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the forwarder has used so far."""
        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def stats(self) -> dict[str, Any] | None:
        """The forwarder's counters, written when it stopped (None before, or without a log)."""
        if self._stats_file is None or not self._stats_file.exists():
            return None
        return json.loads(self._stats_file.read_text())

    def __enter__(self) -> EmulatedLink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the forwarder (its devices go with it); safe twice."""
        if self._closed:
            return
        self._closed = True
        process = self.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def shape_from(
    *,
    bandwidth_mbit: float | None,
    latency_ms: float,
    jitter_ms: float,
    loss_percent: float,
) -> LinkShape:
    """A :class:`LinkShape` from the experiment file's units (Mbit/s, ms, %)."""
    return LinkShape(
        rate_bit_per_s=None if bandwidth_mbit is None else bandwidth_mbit * 1e6,
        delay_s=latency_ms / 1e3,
        jitter_s=jitter_ms / 1e3,
        loss=loss_percent / 100,
    )


def available() -> bool:
    """Whether TAP devices can be created here (``/dev/net/tun`` and root)."""
    return os.path.exists("/dev/net/tun") and os.geteuid() == 0
