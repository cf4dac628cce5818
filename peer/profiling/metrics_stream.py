"""The metrics stream of DESIGN.md: one JSON object per reporting interval (``--metrics-file``).

Fields: ``t, peer, run, epoch, step, loss, samples, samples_per_s, phases {...}, net {sent,
recv, rtt_ms}, cpu_percent, rss_bytes`` and ``gpu {...}`` where there is one (``rtt_ms`` only
when this peer made a small request in the interval: the median over the peers it asked of the
fastest round trip to each, see :meth:`dht.net.transport.ByteCounters.median_rtt_s`). Phases,
samples and bytes are per interval. The training loop calls :meth:`MetricsStream.maybe_report`
after every step: a clock comparison, and the real work (reading the loss, psutil) only once
per interval.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO

import psutil
import torch

from dht.net.transport import ByteCounters
from peer.profiling.phases import PhaseClock

# Seconds between two lines by default (``peer join --metrics-interval``).
METRICS_INTERVAL_S = 5.0


class MetricsStream:
    """Writes the JSON Lines metrics of one peer; ``close`` is safe twice.

    Args:
        path: the file (appended to, so a restarted peer continues its stream).
        peer_id: this peer's id; run_id: the run's name.
        clock: the phase clock whose intervals are reported.
        counters: the transport's byte counters.
        interval_s: seconds between two lines.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        peer_id: str,
        run_id: str,
        clock: PhaseClock,
        counters: ByteCounters,
        interval_s: float = METRICS_INTERVAL_S,
    ):
        self._file: IO[str] | None = Path(path).open("a", encoding="utf-8")
        self._peer_id, self._run_id = peer_id, run_id
        self._clock, self._counters = clock, counters
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._process.cpu_percent()  # the first call only starts psutil's measurement
        self._next_s = time.monotonic() + interval_s
        self._samples = 0
        self._net = (counters.sent, counters.recv)
        self._interval_start_s = time.monotonic()
        self._clock.reset_interval()

    def maybe_report(self, *, epoch: int, step: int, samples: int, loss: torch.Tensor | None):
        """Count ``samples`` of this step; write a line if the interval is over."""
        self._samples += samples
        if time.monotonic() >= self._next_s:
            self.report(epoch=epoch, step=step, loss=loss)

    def report(self, *, epoch: int, step: int, loss: torch.Tensor | None) -> None:
        """Write one line for the interval that ends now."""
        if self._file is None:
            return
        phases = self._clock.reset_interval()
        sent, recv = self._counters.sent, self._counters.recv
        net: dict[str, float] = {"sent": sent - self._net[0], "recv": recv - self._net[1]}
        rtt_s = self._counters.median_rtt_s(self._interval_start_s)
        if rtt_s is not None:
            net["rtt_ms"] = rtt_s * 1e3
        record = {
            "t": time.time(),
            "peer": self._peer_id,
            "run": self._run_id,
            "epoch": epoch,
            "step": step,
            "loss": None if loss is None else float(loss),
            "samples": self._samples,
            "samples_per_s": self._samples / phases.wall_s if phases.wall_s > 0 else 0.0,
            "phases": phases.seconds,
            "net": net,
            "cpu_percent": self._process.cpu_percent(),
            "rss_bytes": self._process.memory_info().rss,
        }
        if torch.cuda.is_available():
            record["gpu"] = {
                "memory_allocated_bytes": torch.cuda.memory_allocated(),
                "memory_reserved_bytes": torch.cuda.memory_reserved(),
            }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._samples, self._net = 0, (sent, recv)
        self._interval_start_s = time.monotonic()
        self._next_s = self._interval_start_s + self.interval_s

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
