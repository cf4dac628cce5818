"""A relay's fair shares: relayed bytes per second, seats and request slots per source address.

A relay's capacity is one pool that every caller and every relayed peer share, so each is split:
relayed bytes are paid as they actually cross (never for an announced ``Content-Length``) into
the caller's own address bucket and into the relay's, and only a caller whose own bucket is in
debt is refused; one address holds at most a few seats (attached peers) and a few of a relayed
peer's request slots, and when either pool is full, at most its fair share of it: a newcomer
address takes a slot from one that holds more (:class:`dht.net.shares.FairSlots`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from dht.net.shares import FairSlots, Slot, address_key

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
    """The relay's byte buckets (one per caller address and one for all), its seats and each
    relayed peer's request slots, shared fairly by the addresses holding or asking for them
    (:class:`dht.net.shares.FairSlots`: under contention an address holding none takes a slot
    from one holding more than its fair share).

    Args:
        rate_per_s: relayed bytes per second, all callers together.
        rate_per_address_per_s: relayed bytes per second of one caller address.
        max_seats: peers attached at once, from every address together.
        max_seats_per_address: peers attached from one address at once.
        max_requests_per_peer: requests forwarded to one relayed peer at once.
        max_requests_per_address: requests from one caller address to one relayed peer at once.
    """

    def __init__(
        self,
        *,
        rate_per_s: float,
        rate_per_address_per_s: float,
        max_seats: int,
        max_seats_per_address: int,
        max_requests_per_peer: int,
        max_requests_per_address: int,
    ):
        self.rate = ByteRate(rate_per_s)
        self.rate_per_address_per_s = rate_per_address_per_s
        self.max_seats_per_address = max_seats_per_address
        self.max_requests_per_peer = max_requests_per_peer
        self.max_requests_per_address = max_requests_per_address
        self._rates: OrderedDict[str, ByteRate] = OrderedDict()
        self.seats = FairSlots(
            capacity=max_seats, max_per_key=max_seats_per_address, unit="relay seats"
        )
        # relayed peer id -> its request slots (kept while any is held)
        self._requests: dict[str, FairSlots] = {}

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

    def request_slots(self, peer_id: str) -> FairSlots:
        """``peer_id``'s request slots (give each back with :meth:`release_request`)."""
        slots = self._requests.get(peer_id)
        if slots is None:
            slots = self._requests[peer_id] = FairSlots(
                capacity=self.max_requests_per_peer,
                max_per_key=self.max_requests_per_address,
                unit="request slots of this peer",
            )
        return slots

    def release_request(self, peer_id: str, slot: Slot) -> None:
        slots = self._requests.get(peer_id)
        if slots is not None:
            slots.release(slot)
            if slots.num_held == 0:
                del self._requests[peer_id]
