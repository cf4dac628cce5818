"""Replay protection in bounded memory: each signed (sender, nonce, timestamp) is accepted once.

The MAC of a request covers its nonce and timestamp, so a replay repeats both. A request is
accepted when its timestamp is within ``window_s`` of this node's clock and its
(sender, nonce) was not seen. Nonces are remembered until their timestamp leaves the window.
Memory is bounded fairly: one sender keeps at most ``max_entries // MAX_SHARE_DIVISOR`` nonces
(beyond it, its own oldest are forgotten) and all together ``max_entries`` (beyond it, the
oldest of all). A forgotten nonce raises a floor *of its sender only*: that sender's requests
stamped at or before it are refused as stale. So a sender that floods, even with timestamps in
the future, pushes only its own floor past the present; every other sender's floor stays at
what it sent itself.
"""

from __future__ import annotations

import heapq
import math
import time

from dht.errors import AuthError, ConfigError

MAX_SHARE_DIVISOR = 8  # one sender keeps at most this fraction of the remembered nonces


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
        self.max_per_sender = max(1, max_entries // MAX_SHARE_DIVISOR)
        self._seen: dict[bytes, float] = {}
        self._by_ts: list[tuple[float, bytes, str]] = []  # a heap over every sender
        self._own: dict[str, list[tuple[float, bytes]]] = {}  # a heap per sender
        self._floors: dict[str, float] = {}

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
        if stamp <= self._floors.get(sender, -math.inf):
            raise AuthError("stale request: older than the replay guard remembers")
        self._forget(now_s)
        key = sender.encode() + b"/" + nonce.encode()
        if key in self._seen:
            raise AuthError("replayed request (nonce seen before)")
        self._seen[key] = stamp
        heapq.heappush(self._by_ts, (stamp, key, sender))
        own = self._own.setdefault(sender, [])
        heapq.heappush(own, (stamp, key))
        while len(own) > self.max_per_sender:
            oldest_ts, oldest = heapq.heappop(own)
            self._drop(oldest, oldest_ts, sender)
        while len(self._seen) > self.max_entries:
            oldest_ts, oldest, owner = heapq.heappop(self._by_ts)
            if self._seen.get(oldest) == oldest_ts:
                self._drop(oldest, oldest_ts, owner)
                _remove(self._own.get(owner), oldest)

    def _drop(self, key: bytes, stamp: float, sender: str) -> None:
        """Forget ``key`` before its time: its sender's floor rises to it."""
        if self._seen.pop(key, None) is not None:
            self._floors[sender] = max(self._floors.get(sender, -math.inf), stamp)

    def _forget(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._by_ts and self._by_ts[0][0] < horizon:
            stamp, key, sender = heapq.heappop(self._by_ts)
            if self._seen.get(key) == stamp:
                del self._seen[key]
                _remove(self._own.get(sender), key)
            if not self._own.get(sender, True):
                del self._own[sender]
        if len(self._floors) > self.max_entries:  # floors below the window refuse nothing more
            self._floors = {s: f for s, f in self._floors.items() if f >= horizon}


def _remove(heap: list[tuple[float, bytes]] | None, key: bytes) -> None:
    """Take ``key`` out of a sender's heap (usually its oldest entry: cheap)."""
    if not heap:
        return
    if heap[0][1] == key:
        heapq.heappop(heap)
        return
    for index, (_, other) in enumerate(heap):
        if other == key:
            heap[index] = heap[-1]
            heap.pop()
            heapq.heapify(heap)
            return
