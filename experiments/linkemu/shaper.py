"""One direction of an emulated link: loss, a rate-limited drop-tail queue, delay and jitter.

The model follows what ``netem`` + ``tbf`` do on a real interface, in this order: a frame is
dropped at random with the loss probability; otherwise it joins a FIFO drained at the link's rate
(it is tail-dropped when the FIFO already holds :attr:`LinkShape.queue_s` of backlog); when it
has left the FIFO it spends the one-way delay (plus a normally distributed jitter) on the wire.
Frames are delivered in order: jitter never reorders them (unlike netem's default), because
reordering on one path is rare on the internet and makes TCP see spurious losses.

Torch-free and I/O-free, so it is tested without namespaces.
"""

from __future__ import annotations

import dataclasses
import random

# Ethernet frame bytes the FIFO may hold at least, whatever the rate (a few full-size frames).
MIN_QUEUE_BYTES = 16 * 1514


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkShape:
    """How one direction of a link behaves.

    Attributes:
        rate_bit_per_s: the rate frames leave the queue at (Ethernet header included, as tbf
            counts); None: no limit.
        delay_s: one-way delay added to every frame, seconds.
        jitter_s: standard deviation of a normal variation of the delay, seconds.
        loss: probability of dropping a frame, 0..1.
        queue_s: the FIFO's capacity, in seconds of traffic at the rate (tbf's ``latency``).
    """

    rate_bit_per_s: float | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    queue_s: float = 0.1

    def __post_init__(self) -> None:
        if self.rate_bit_per_s is not None and self.rate_bit_per_s <= 0:
            raise ValueError(f"rate_bit_per_s: must be > 0, got {self.rate_bit_per_s}")
        for name in ("delay_s", "jitter_s", "queue_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss: must be within 0..1, got {self.loss}")

    @property
    def queue_bytes(self) -> float:
        """The FIFO's capacity in bytes (infinite without a rate)."""
        if self.rate_bit_per_s is None:
            return float("inf")
        return max(MIN_QUEUE_BYTES, self.rate_bit_per_s / 8 * self.queue_s)


@dataclasses.dataclass
class ShaperStats:
    """Counters of one direction."""

    num_frames: int = 0
    num_bytes: int = 0
    num_lost: int = 0
    num_tail_dropped: int = 0


class Shaper:
    """Decides when (or whether) each frame of one direction is delivered; see the module."""

    def __init__(self, shape: LinkShape, *, seed: int | None = None):
        self.shape = shape
        self.stats = ShaperStats()
        self._random = random.Random(seed)
        self._busy_until_s = 0.0  # when the FIFO has sent everything admitted so far
        self._last_due_s = 0.0

    def admit(self, now_s: float, size_bytes: int) -> float | None:
        """A frame of ``size_bytes`` arrives at ``now_s`` (monotonic seconds): the time it is
        to be delivered, or None if it is dropped."""
        shape, stats = self.shape, self.stats
        stats.num_frames += 1
        if shape.loss and self._random.random() < shape.loss:
            stats.num_lost += 1
            return None
        departure_s = now_s
        if shape.rate_bit_per_s is not None:
            start_s = max(now_s, self._busy_until_s)
            backlog_bytes = (start_s - now_s) * shape.rate_bit_per_s / 8
            if backlog_bytes + size_bytes > shape.queue_bytes:
                stats.num_tail_dropped += 1
                return None
            departure_s = start_s + size_bytes * 8 / shape.rate_bit_per_s
            self._busy_until_s = departure_s
        delay_s = shape.delay_s
        if shape.jitter_s:
            delay_s = max(0.0, self._random.gauss(shape.delay_s, shape.jitter_s))
        due_s = max(departure_s + delay_s, self._last_due_s)
        self._last_due_s = due_s
        stats.num_bytes += size_bytes
        return due_s
