"""Numpy work of a round: run inline when small, in a worker thread when large, and timed.

Compression, decoding and reduction of big chunks hold the CPU for milliseconds; running them in
a thread keeps the event loop serving the sockets meanwhile (numpy releases the GIL for them).
Small pieces run inline, where a thread hand-off would cost more than the work.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class WorkStats:
    """Bytes moved and CPU seconds spent by one peer in one all-reduce.

    Attributes:
        bytes_sent: chunk headers and payloads this peer sent (both roles).
        bytes_received: chunk headers and payloads it received (both roles).
        cpu_s: seconds of numpy work by kind: "encode", "decode", "reduce".
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    cpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class Worker:
    """Runs numpy work for a round, inline or in a thread by size, and accounts for it.

    Args:
        stats: where the seconds go.
        offload_min_numel: work on at least this many values runs in a thread.
    """

    def __init__(self, stats: WorkStats, offload_min_numel: int):
        self.stats = stats
        self._offload_min_numel = offload_min_numel

    async def run(self, kind: str, numel: int, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, timed under ``kind``; in a thread when ``numel`` is large."""
        if numel < self._offload_min_numel:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.stats.cpu_s[kind] += time.perf_counter() - start
        future = asyncio.get_running_loop().run_in_executor(None, _timed, fn, *args)
        try:
            result, elapsed_s = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread writes into buffers the caller owns (the peer's tensors): wait until it
            # is done before the cancellation unwinds and the caller releases or reuses them.
            await asyncio.wait({future})
            raise
        self.stats.cpu_s[kind] += elapsed_s
        return result


def _timed(fn: Callable[..., T], *args) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
