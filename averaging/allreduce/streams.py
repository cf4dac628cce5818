"""How many streams each sender opens to each reducer: one on a short link; on a long one, the
number that moved bytes fastest in this peer's recent rounds.

One TCP flow's throughput is bounded by its window over the RTT and, on a link that drops
packets, by about ``MSS / (RTT * sqrt(loss))`` (Mathis et al., 1997) for loss-based congestion
control (CUBIC, Reno: the defaults of most volunteers' systems). So on a long lossy link one
flow leaves most of the pipe empty, and several flows fill it (PCCL's connection pools, GridFTP's
parallel streams). Without loss they gain nothing and cost a little (their slow starts overrun
the bottleneck's queue together); see docs/EXPERIMENTS.md for the figures.

A peer measures the RTT for free (every RPC it makes), but not the loss rate or the link's
capacity. So the leader of a group:

* takes one stream while the median RTT it measured is under ``rtt_per_stream_s`` (loopback,
  LAN: nothing to gain, and nothing is tried);
* otherwise tries each number from 1 to ``max_streams_per_pair`` once, the RTT's guess first
  (one stream per ``rtt_per_stream_s`` of RTT) and then outward from it, and after that takes
  the number whose rounds had the highest median goodput (tensor bytes over all-reduce seconds,
  complete rounds only), trying a neighbour of it every ``_EXPLORE_EVERY`` groups so that a link
  that changes is followed.

Every member learns from every round it takes part in, whoever led it. ``streams_per_pair``
fixes the number instead.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable

from averaging.config import AveragerConfig

_NUM_REMEMBERED = 8  # goodputs remembered per number of streams
_EXPLORE_EVERY = 8  # every this many groups led, a neighbour of the best is tried again


class StreamChooser:
    """Chooses the number of streams per pair for the groups this peer leads.

    Args:
        config: ``streams_per_pair`` (0: automatic), ``max_streams_per_pair`` and
            ``rtt_per_stream_s``.
        rtt_s: the median RTT this peer measured lately, in seconds (None: nothing measured).
    """

    def __init__(self, config: AveragerConfig, rtt_s: Callable[[], float | None]):
        self._config = config
        self._rtt_s = rtt_s
        self._goodput: dict[int, collections.deque[float]] = {
            n: collections.deque(maxlen=_NUM_REMEMBERED)
            for n in range(1, config.max_streams_per_pair + 1)
        }
        self._num_chosen = 0

    def guess(self) -> int:
        """The number the RTT alone suggests (1 for a short or unmeasured link)."""
        rtt_s = self._rtt_s()
        if rtt_s is None or not math.isfinite(rtt_s) or rtt_s <= 0:
            return 1
        wanted = math.ceil(rtt_s / self._config.rtt_per_stream_s)
        return max(1, min(self._config.max_streams_per_pair, wanted))

    def choose(self) -> int:
        """Streams per pair for a group formed now."""
        if self._config.streams_per_pair:
            return self._config.streams_per_pair
        guess = self.guess()
        if guess == 1:
            return 1
        self._num_chosen += 1
        by_distance = sorted(self._goodput, key=lambda n: (abs(n - guess), n))
        untried = [n for n in by_distance if not self._goodput[n]]
        if untried:
            return untried[0]
        best = max(self._goodput, key=lambda n: (statistics.median(self._goodput[n]), -n))
        if self._num_chosen % _EXPLORE_EVERY == 0:
            neighbours = [n for n in (best - 1, best + 1) if n in self._goodput]
            return min(neighbours, key=lambda n: len(self._goodput[n]))
        return best

    def observe(self, num_streams: int, num_bytes: int, allreduce_s: float) -> None:
        """A complete round with ``num_streams`` streams per pair moved ``num_bytes`` (sent and
        received) in ``allreduce_s`` seconds."""
        samples = self._goodput.get(num_streams)
        if samples is not None and num_bytes > 0 and allreduce_s > 0:
            samples.append(num_bytes / allreduce_s)

    def goodput_bytes_per_s(self) -> dict[int, float]:
        """The median goodput measured per number of streams (those measured)."""
        return {n: statistics.median(g) for n, g in self._goodput.items() if g}
