"""A relay's fair shares: relayed bytes per second, seats and request slots per source address.

A relay's capacity is one pool that every caller and every relayed peer share, so each is split:
relayed bytes are paid as they actually cross (never for an announced ``Content-Length``) into
the caller's own address bucket and into the relay's, and only a caller whose own bucket is in
debt is refused; one address holds at most a few seats (attached peers) and a few of a relayed
peer's request slots.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager

from dht.net.shares import address_key

MAX_TRACKED_ADDRESSES = 4096  # address buckets kept; a forgotten one starts full (memory only)


class ByteRate:
    """A token bucket of bytes that may go into debt: what crossed is taken at once, and the
    payer waits until the rate has paid it back.

    Args:
        rate_per_s: bytes per second; the bucket holds one second of them.
    """

    def __init__(self, rate_per_s: float):
        self.rate_per_s = rate_per_s
        self._tokens = rate_per_s
        self._last_s = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.rate_per_s, self._tokens + (now - self._last_s) * self.rate_per_s)
        self._last_s = now

    def spent(self) -> bool:
        self._refill()
        return self._tokens < 0

    def take(self, num_bytes: int) -> float:
        """Take ``num_bytes``; the seconds until the bucket is out of debt again."""
        self._refill()
        self._tokens -= num_bytes
        return max(0.0, -self._tokens / self.rate_per_s)

    async def pay(self, num_bytes: int) -> None:
        """Take ``num_bytes`` and wait until the bucket is out of debt."""
        wait_s = self.take(num_bytes)
        if wait_s > 0:
            await asyncio.sleep(wait_s)


class RelayShares:
    """The relay's byte buckets (one per caller address and one for all) and its counts of
    seats and request slots per address.

    Args:
        rate_per_s: relayed bytes per second, all callers together.
        rate_per_address_per_s: relayed bytes per second of one caller address.
        max_seats_per_address: peers attached from one address at once.
        max_requests_per_address: requests from one caller address to one relayed peer at once.
    """

    def __init__(
        self,
        *,
        rate_per_s: float,
        rate_per_address_per_s: float,
        max_seats_per_address: int,
        max_requests_per_address: int,
    ):
        self.rate = ByteRate(rate_per_s)
        self.rate_per_address_per_s = rate_per_address_per_s
        self.max_seats_per_address = max_seats_per_address
        self.max_requests_per_address = max_requests_per_address
        self._rates: OrderedDict[str, ByteRate] = OrderedDict()
        self._seats: Counter[str] = Counter()
        self._requests: Counter[tuple[str, str]] = Counter()

    def address_rate(self, host: str) -> ByteRate:
        """The byte bucket of the caller address ``host``."""
        key = address_key(host)
        rate = self._rates.pop(key, None) or ByteRate(self.rate_per_address_per_s)
        self._rates[key] = rate
        while len(self._rates) > MAX_TRACKED_ADDRESSES:
            self._rates.popitem(last=False)
        return rate

    async def pay(self, rate: ByteRate, num_bytes: int) -> None:
        """Pay bytes that crossed into the caller's bucket and the relay's (waiting for both)."""
        wait_s = max(rate.take(num_bytes), self.rate.take(num_bytes))
        if wait_s > 0:
            await asyncio.sleep(wait_s)

    def seat_free(self, host: str) -> bool:
        return self._seats[address_key(host)] < self.max_seats_per_address

    @contextmanager
    def seat(self, host: str):
        """Hold a seat of ``host`` while a tunnel attached from it lives."""
        key = address_key(host)
        self._seats[key] += 1
        try:
            yield
        finally:
            _decrement(self._seats, key)

    @contextmanager
    def request_slot(self, peer_id: str, host: str):
        """Hold one of ``peer_id``'s request slots for the caller at ``host``; raises
        :class:`OverShareError` when that address holds its share of them."""
        key = (peer_id, address_key(host))
        if self._requests[key] >= self.max_requests_per_address:
            raise OverShareError(
                f"this address has {self.max_requests_per_address} requests to this peer "
                "in progress"
            )
        self._requests[key] += 1
        try:
            yield
        finally:
            _decrement(self._requests, key)


class OverShareError(Exception):
    """A caller address asked for more than its share."""


def _decrement(counter: Counter, key) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
