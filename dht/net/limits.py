"""What a node spends on others before and after they proved who they are, bounded.

* :class:`ConnectionGate`: open TCP connections, in all and per source address, and new ones per
  source address per second; a connection over a cap or its address's share is closed at once,
  before a byte of it is parsed.
* :class:`BytesBudget`: request bytes being received before their digest is checked, across all
  requests; a request that does not fit is refused at once (503) instead of being buffered.
* :class:`RateLimiter`: a token bucket per source address (dial-backs, see `dht.reach`).
* :class:`StreamSlots`: concurrent streams, a share per proven peer id and a fair share per source
  address.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager

from dht.net.request_shares import RateShares
from dht.net.shares import FairSlots, OverShare, Slot, address_key

logger = logging.getLogger(__name__)
MAX_CHECKED_PEERNAMES = 4096  # accepted connections remembered until aiohttp sets them up


def peer_host(transport: asyncio.BaseTransport | None) -> str:
    """The source IP of a connection ("" when unknown, e.g. a closed transport)."""
    if transport is None:
        return ""
    peername = transport.get_extra_info("peername")
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return ""


class ConnectionGate:
    """Counts the server's connections and closes those over the caps or the accept shares.

    It hooks the aiohttp ``web.Server`` (the protocol factory of the listening socket):
    aiohttp calls the server's ``connection_made`` / ``connection_lost`` for every connection,
    which is the earliest point of aiohttp that knows the peer's address; a connection refused
    there is aborted before a byte of it is parsed. The server's listening sockets
    (:class:`dht.net.listener.GatedSocket`) ask :meth:`admit` earlier still, at ``accept()``,
    and reset a refused connection before asyncio builds anything for it.

    Open connections are shared fairly (:class:`dht.net.shares.FairSlots`): while all
    ``max_connections`` are open, an address holding fewer than its fair share (``max(1,
    max_connections / addresses holding or asking)``) is let in, and the oldest connection of
    the address holding the most, over its own share, is aborted; so a few addresses at their
    ``max_per_address`` never lock every other address out.

    Args:
        max_connections: the most connections open at once.
        max_per_address: the most connections open at once from one source address (an IPv6
            /64 counts as one).
        accepts_per_s_per_address: new connections accepted from one source address per
            second, sustained, while contended (see ``contention_window_s``).
        accept_burst_per_address: new connections one source address may open at once before
            that rate applies.
        contention_window_s: the accept share applies while another address opened a
            connection within this many seconds, or made a request (``requests``) within its
            own window: alone, an address may open as many as it likes.
        requests: the server's request shares of source addresses (their recent use tells
            whether others are being served); None: connections only.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        max_per_address: int,
        accepts_per_s_per_address: float,
        accept_burst_per_address: float,
        contention_window_s: float,
        requests: RateShares | None = None,
    ):
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.accepts = RateShares(
            rate_per_s=accepts_per_s_per_address, burst=accept_burst_per_address,
            max_hold_s=0.0, holder="address", what="connections",
            contention_window_s=contention_window_s,
        )  # fmt: skip
        self._requests = requests
        self.num_refused = 0
        self.num_refused_for_rate = 0
        # shared fairly under contention: when all are open, a newcomer address's connection
        # aborts the oldest of an address over its fair share (see FairSlots)
        self._slots = FairSlots(
            capacity=max_connections, max_per_key=max_per_address, unit="connections"
        )
        self._open: dict[object, Slot] = {}
        self._checked: OrderedDict[object, None] = OrderedDict()
        self._last_warning_s = -float("inf")

    @property
    def num_open(self) -> int:
        return self._slots.num_held

    def open_from(self, host: str) -> int:
        """Connections open from ``host``'s address (its /64 for IPv6)."""
        return self._slots.held_by(address_key(host))

    def admit(self, host: str) -> bool:
        """Whether a new connection from ``host`` (a raw source IP) may stay open; a refusal is
        counted. Over a cap of open connections, no accept token is taken."""
        address = address_key(host)
        if not self._admit_open(address):
            return False
        contended = self._requests is not None and self._requests.contended(address)
        if self.accepts.take(address, contended=contended) is not None:
            self.num_refused += 1
            self.num_refused_for_rate += 1
            self._warn(address, "accepted per second")
            return False
        return True

    def _admit_open(self, address: str) -> bool:
        if self._slots.can_take(address):
            return True
        self.num_refused += 1
        self._warn(address, "open")
        return False

    def checked_at_accept(self, peername: object) -> None:
        """The connection from ``peername`` passed :meth:`admit` when it was accepted
        (:class:`dht.net.listener.GatedSocket`): when aiohttp sets it up, only the caps of open
        connections are checked again (a few may have been accepted at once), no accept token
        is taken twice. Bounded: one that never reaches aiohttp (a TLS handshake that failed)
        is forgotten in time."""
        self._checked[peername] = None
        while len(self._checked) > MAX_CHECKED_PEERNAMES:
            self._checked.popitem(last=False)

    def install(self, server) -> None:
        """Wrap ``server.connection_made`` / ``connection_lost`` (an aiohttp ``web.Server``)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            host = peer_host(transport)
            peername = transport.get_extra_info("peername")
            if peername in self._checked:
                del self._checked[peername]
                admitted = self._admit_open(address_key(host))
            else:  # (it did not come through a gated socket)
                admitted = self.admit(host)
            if not admitted:
                # Abort once aiohttp has set the connection up (its request task is scheduled
                # right after this hook returns): its connection_lost then cleans up as for any
                # client that hung up, and nothing of the connection is ever parsed.
                asyncio.get_running_loop().call_soon(transport.abort)
                return
            slot, evicted = self._slots.take(address_key(host))  # (can_take just said yes)
            slot.holder = transport
            self._open[handler] = slot
            if evicted is not None:  # an address over its fair share gives up its oldest
                evicted.holder.abort()

        def connection_lost(handler, exc=None) -> None:
            slot = self._open.pop(handler, None)
            if slot is not None:
                self._slots.release(slot)  # (a no-op for one evicted)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def _warn(self, address: str, cap: str) -> None:
        now = time.monotonic()
        if now - self._last_warning_s >= 10.0:  # a flood must not flood the log too
            self._last_warning_s = now
            logger.warning(
                "refused connections over the caps (%s; %d open, %d from %s; %d refused so "
                "far, %d for their rate)",
                cap, self._slots.num_held, self._slots.held_by(address), address or "?",
                self.num_refused, self.num_refused_for_rate,
            )  # fmt: skip


class BytesBudget:
    """A shared allowance of bytes, reserved before reading and released after."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_use = 0

    def reserve(self, num_bytes: int) -> _Reservation:
        """Hold ``num_bytes`` for a ``with`` block; entering raises :class:`OverBudget` if they
        do not fit."""
        return _Reservation(self, num_bytes)


class _Reservation:
    __slots__ = ("_budget", "_num_bytes")

    def __init__(self, budget: BytesBudget, num_bytes: int):
        self._budget = budget
        self._num_bytes = num_bytes

    def __enter__(self) -> None:
        budget = self._budget
        if budget.in_use + self._num_bytes > budget.max_bytes:
            raise OverBudget(f"{budget.in_use} of {budget.max_bytes} bytes in flight")
        budget.in_use += self._num_bytes

    def __exit__(self, *exc_info: object) -> None:
        self._budget.in_use -= self._num_bytes


class OverBudget(Exception):
    """A reservation did not fit."""


class RateLimiter:
    """A token bucket per key (a source address), in bounded memory.

    Args:
        rate_per_s: tokens added per second.
        burst: the most tokens a bucket holds.
        max_keys: the most buckets kept; the least recently used is forgotten (a forgotten key
            starts full again, so this only bounds memory, never blocks a newcomer).
    """

    def __init__(self, *, rate_per_s: float, burst: float, max_keys: int = 4096):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str, now_s: float | None = None) -> bool:
        """Take one token for ``key``; False if its bucket is empty."""
        now_s = time.monotonic() if now_s is None else now_s
        tokens, last_s = self._buckets.pop(key, (self.burst, now_s))
        tokens = min(self.burst, tokens + (now_s - last_s) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - allowed, now_s)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed


class StreamSlots:
    """Concurrent streams: a fixed share per proven peer id, and a fair share per source address
    (an IPv6 /64 counts as one address) of the streams open at once (:class:`FairSlots`: when
    all are open, an address holding fewer than its fair share takes one from an address over
    its own, whose stream is cancelled: its connection closes). A stream whose address is not
    known is counted under its peer id.

    Args:
        max_per_peer: streams one proven peer id may hold open at once.
        max_per_address: streams one source address may hold open at once.
        max_total: streams open at once, from everyone together.
    """

    def __init__(self, *, max_per_peer: int, max_per_address: int, max_total: int):
        self.max_per_peer = max_per_peer
        self.max_per_address = max_per_address
        self._slots = FairSlots(
            capacity=max_total, max_per_key=max_per_address, unit="concurrent streams"
        )
        self._per_peer: Counter[str] = Counter()

    @property
    def num_open(self) -> int:
        return self._slots.num_held

    @contextmanager
    def hold(self, peer: str, host: str):
        """Hold a slot for the ``with`` block (run by the stream's own task, which is cancelled
        if a newcomer address takes the slot); raises :class:`OverBudget` when none is free."""
        if peer and self._per_peer[peer] >= self.max_per_peer:
            raise OverBudget(f"this peer holds its share of {self.max_per_peer} concurrent streams")
        try:
            slot, evicted = self._slots.take(address_key(host) or f"peer/{peer}")
        except OverShare as e:
            raise OverBudget(str(e)) from None
        slot.holder = asyncio.current_task()
        if evicted is not None and isinstance(evicted.holder, asyncio.Task):
            evicted.holder.cancel()  # it stops at its next wait, and gives its slot back
        if peer:
            self._per_peer[peer] += 1
        try:
            yield
        finally:
            self._slots.release(slot)
            if peer:
                self._per_peer[peer] -= 1
                if self._per_peer[peer] <= 0:
                    del self._per_peer[peer]
