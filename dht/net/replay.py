"""Replay protection in bounded memory: each signed (sender, nonce, timestamp) is accepted once.

The MAC of a request covers its nonce and timestamp, so a replay repeats both. A request is
accepted when its timestamp is within ``window_s`` of this node's clock and its
(sender, nonce) was not seen. Nonces are remembered until their timestamp leaves the window. When
more than ``max_entries`` are remembered (a flood), the oldest timestamps are forgotten and a
floor rises to the newest timestamp forgotten: requests stamped at or before it are refused as
stale. Honest requests arrive within moments of their timestamp, so they stay above the floor
unless a flood of ``max_entries`` requests arrived within that moment.
"""

from __future__ import annotations

import heapq
import math
import time

from dht.errors import AuthError, ConfigError


class ReplayGuard:
    """Remembers recent (sender, nonce) pairs.

    Args:
        window_s: the accepted distance of a timestamp from this node's clock, in seconds.
        max_entries: the most pairs remembered at once.
    """

    def __init__(self, *, window_s: float, max_entries: int):
        if not window_s > 0:
            raise ConfigError(f"replay_window_s must be positive, got {window_s}")
        if max_entries < 1:
            raise ConfigError(f"max_remembered_nonces must be >= 1, got {max_entries}")
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[bytes, float] = {}
        self._by_ts: list[tuple[float, bytes]] = []  # a heap
        self._floor_ts = -math.inf

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, sender: str, nonce: str, ts: str, now_s: float | None = None) -> None:
        """Accept this (sender, nonce) once, or raise :class:`AuthError`."""
        now_s = time.time() if now_s is None else now_s
        try:
            stamp = float(ts)
        except ValueError:
            raise AuthError("malformed timestamp") from None
        if not math.isfinite(stamp) or abs(now_s - stamp) > self.window_s:
            raise AuthError(f"stale request: timestamp {ts[:20]} is not within the window")
        if stamp <= self._floor_ts:
            raise AuthError("stale request: older than the replay guard remembers")
        self._forget(now_s)
        key = sender.encode() + b"/" + nonce.encode()
        if key in self._seen:
            raise AuthError("replayed request (nonce seen before)")
        self._seen[key] = stamp
        heapq.heappush(self._by_ts, (stamp, key))
        while len(self._seen) > self.max_entries:
            oldest_ts, oldest = heapq.heappop(self._by_ts)
            del self._seen[oldest]
            self._floor_ts = max(self._floor_ts, oldest_ts)

    def _forget(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._by_ts and self._by_ts[0][0] < horizon:
            _, key = heapq.heappop(self._by_ts)
            del self._seen[key]
