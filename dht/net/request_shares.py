"""Fair shares of request handling: a rate of requests per proven peer and per source address.

Every request costs the node's event loop something (parsing, routing, a MAC, a body read, a
refusal) whatever is done with it, so a sender that floods requests takes the loop from every
other peer even if each of its requests is refused. Here each source address (an IPv6 /64 counts
as one) and each proven peer id has a token bucket of requests: a request that finds its bucket
empty is refused at once (429 with a ``Retry-After``) before any further work: the address's
bucket is checked before the request is authenticated, the peer's right after (a few
microseconds: a cached ticket and one HMAC).

A refusal answered at once invites a retry at once, and refusing also costs the loop. So a sender
that comes back before the ``Retry-After`` it was told waits for its next refusal until that time
(at most ``max_hold_s``): each of its connections then sends at most one request per hold, and
its connections per address are capped, open ones and new ones a second
(:class:`dht.net.limits.ConnectionGate`). A sender that honours ``Retry-After`` is never held.
A handshake is a request of its address too, and has a share of its own (a signature check).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from dht.net.shares import address_key, same_source


@dataclass(frozen=True)
class RateRefusal:
    """Why a request is refused for its rate, and what to answer.

    Attributes:
        reason: one line for the ``x-vp-error`` header.
        retry_after_s: the ``Retry-After`` to announce, in whole seconds (at least 1).
        hold_s: how long to wait before answering (0: at once), in seconds.
    """

    reason: str
    retry_after_s: int
    hold_s: float


class TokenBuckets:
    """A token bucket per key (units per second, e.g. signatures to check), in bounded memory.

    Args:
        rate_per_s: units a key may take per second, sustained.
        burst: units a key may take at once before that rate applies.
        max_keys: the most buckets kept; the least recently used is forgotten (a forgotten key
            starts full again: this bounds memory only).
    """

    def __init__(self, *, rate_per_s: float, burst: float, max_keys: int = 4096):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def shortfall_s(self, key: str, units: float, now_s: float | None = None) -> float:
        """Take ``units`` from ``key``'s bucket: 0 if they were there, else nothing is taken and
        the seconds until they will be (infinite for more than a burst)."""
        now_s = time.monotonic() if now_s is None else now_s
        tokens, last_s = self._buckets.pop(key, (self.burst, now_s))
        tokens = min(self.burst, tokens + max(0.0, now_s - last_s) * self.rate_per_s)
        wait_s = 0.0
        if units > self.burst:
            wait_s = math.inf
        elif tokens >= units:
            tokens -= units
        else:
            wait_s = (units - tokens) / self.rate_per_s
        self._buckets[key] = (tokens, now_s)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait_s


class _Bucket:
    __slots__ = ("last_s", "tokens", "told_until_s")

    def __init__(self, tokens: float, now_s: float):
        self.tokens = tokens
        self.last_s = now_s
        self.told_until_s = -math.inf  # the end of the last Retry-After this holder was told


class RateShares:
    """Token buckets of requests per key, in bounded memory.

    Args:
        rate_per_s: requests a key may make per second, sustained.
        burst: requests a key may make at once before that rate applies.
        max_hold_s: the longest a refusal waits for a sender that ignored its ``Retry-After``.
        holder: what a key is, for the refusal's reason ("peer", "address").
        what: what is counted, for the refusal's reason ("requests", "handshakes").
        contention_window_s: None: the share always applies. Else it applies only while
            another key made a request within this many seconds: a key alone may use the whole
            node (a swarm on one host, all at one address, is never refused for its rate).
        max_keys: the most buckets kept; the least recently used is forgotten (a forgotten key
            starts full again: this bounds memory only).
    """

    def __init__(
        self,
        *,
        rate_per_s: float,
        burst: float,
        max_hold_s: float,
        holder: str,
        what: str = "requests",
        contention_window_s: float | None = None,
        max_keys: int = 4096,
    ):
        self.what = what
        self.contention_window_s = contention_window_s
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_hold_s = max_hold_s
        self.holder = holder
        self.max_keys = max_keys
        self.num_refused = 0
        self.num_held = 0
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(
        self, key: str, now_s: float | None = None, *, contended: bool = False
    ) -> RateRefusal | None:
        """Take one request's token for ``key``: None if it had one, the refusal otherwise.
        ``contended``: the share applies whatever the contention window says (the caller knows
        of another key's use elsewhere)."""
        now_s = time.monotonic() if now_s is None else now_s
        contended = contended or self.contended(key, now_s)
        bucket = self._bucket(key, now_s)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        if not contended:
            return None
        return self._refuse(bucket, now_s)

    def contended(self, key: str, now_s: float | None = None) -> bool:
        """Whether another source than ``key``'s made a request within the contention window
        (an address and the same address passed by a relay are one source: see
        :func:`dht.net.shares.same_source`; the buckets are in order of use, so the most recent
        other source is one of the last three)."""
        if self.contention_window_s is None:
            return True
        now_s = time.monotonic() if now_s is None else now_s
        for other in itertools.islice(reversed(self._buckets), 3):
            if not same_source(other, key):
                return now_s - self._buckets[other].last_s <= self.contention_window_s
        return False

    def charge(self, key: str, units: float, now_s: float | None = None) -> None:
        """Take ``units`` more from ``key``'s bucket for work already done (the bytes of a body
        that arrived): never refused, but the bucket may go into debt (down to minus a burst),
        so that the next requests are refused until it is paid back."""
        now_s = time.monotonic() if now_s is None else now_s
        bucket = self._bucket(key, now_s)
        bucket.tokens = max(-self.burst, bucket.tokens - units)

    def drain(self, key: str, now_s: float | None = None) -> int:
        """Empty ``key``'s bucket (its request was refused deeper in, e.g. its share of some
        pool is in use: a retry at once would be refused again); the ``Retry-After`` to tell."""
        now_s = time.monotonic() if now_s is None else now_s
        bucket = self._bucket(key, now_s)
        bucket.tokens = min(bucket.tokens, 0.0)
        retry_after_s = self._retry_after_s(bucket)
        bucket.told_until_s = max(bucket.told_until_s, now_s + retry_after_s)
        return retry_after_s

    def _bucket(self, key: str, now_s: float) -> _Bucket:
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = _Bucket(self.burst, now_s)
        else:
            elapsed_s = max(0.0, now_s - bucket.last_s)
            bucket.tokens = min(self.burst, bucket.tokens + elapsed_s * self.rate_per_s)
            bucket.last_s = now_s
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return bucket

    def _retry_after_s(self, bucket: _Bucket) -> int:
        return max(1, math.ceil((1.0 - bucket.tokens) / self.rate_per_s))

    def _refuse(self, bucket: _Bucket, now_s: float) -> RateRefusal:
        self.num_refused += 1
        hold_s = 0.0
        if now_s < bucket.told_until_s:  # it came back before it was told to
            hold_s = min(self.max_hold_s, bucket.told_until_s - now_s)
            self.num_held += 1
        retry_after_s = self._retry_after_s(bucket)
        bucket.told_until_s = max(bucket.told_until_s, now_s + hold_s + retry_after_s)
        reason = (
            f"too many {self.what} from this {self.holder}: its share is {self.rate_per_s:g} "
            f"a second (bursts of {self.burst:g}); retry after {retry_after_s} s"
        )
        return RateRefusal(reason, retry_after_s, hold_s)


class HandshakeShares(RateShares):
    """Handshakes per source address (an IPv6 /64): each costs a signature check, so they have a
    share of their own, which always applies."""

    def __init__(self, *, rate_per_s: float, burst: float, max_hold_s: float):
        super().__init__(
            rate_per_s=rate_per_s, burst=burst, max_hold_s=max_hold_s, holder="address",
            what="handshakes",
        )  # fmt: skip

    def allow(self, host: str) -> bool:
        """Take one handshake's token for ``host`` (a raw source IP); False if it had none (for
        the relay, which counts the handshakes it forwards to the peers relayed there)."""
        return self.take(address_key(host)) is None


class RequestShares:
    """The request-rate shares of one server: per source address and per proven peer, and the
    handshakes per source address.

    Args:
        rate_per_s_per_peer, burst_per_peer: one proven peer id's bucket.
        rate_per_s_per_address, burst_per_address: one source address's bucket (an IPv6 /64).
        handshakes_per_s_per_address, handshake_burst: one source address's bucket of
            handshakes (each also counts as a request of its address).
        max_hold_s: the longest a refusal of a sender that ignored its ``Retry-After`` waits.
        contention_window_s: an address's share applies while another address made a request
            within this many seconds (alone, an address may use the whole node); a peer's share
            always applies.
    """

    def __init__(
        self,
        *,
        rate_per_s_per_peer: float,
        burst_per_peer: float,
        rate_per_s_per_address: float,
        burst_per_address: float,
        handshakes_per_s_per_address: float,
        handshake_burst: float,
        max_hold_s: float,
        contention_window_s: float,
    ):
        self.peers = RateShares(
            rate_per_s=rate_per_s_per_peer, burst=burst_per_peer, max_hold_s=max_hold_s,
            holder="peer",
        )  # fmt: skip
        self.addresses = RateShares(
            rate_per_s=rate_per_s_per_address, burst=burst_per_address, max_hold_s=max_hold_s,
            holder="address", contention_window_s=contention_window_s,
        )  # fmt: skip
        self.hellos = HandshakeShares(
            rate_per_s=handshakes_per_s_per_address, burst=handshake_burst, max_hold_s=max_hold_s
        )

    @property
    def num_refused(self) -> int:
        return self.peers.num_refused + self.addresses.num_refused + self.hellos.num_refused

    @property
    def num_held(self) -> int:
        return self.peers.num_held + self.addresses.num_held + self.hellos.num_held

    def take_address(self, host: str) -> RateRefusal | None:
        """A request from ``host`` (a raw source IP; "" is unknown, e.g. relayed: not counted)."""
        return self.addresses.take(address_key(host)) if host else None

    def take_hello(self, host: str) -> RateRefusal | None:
        """A handshake from ``host`` (a raw source IP; "" is unknown: not counted): one request
        of its address's share, and one of its handshakes (not taken if the first refused)."""
        if not host:
            return None
        address = address_key(host)
        return self.addresses.take(address) or self.hellos.take(address)

    def take_peer(self, peer: str) -> RateRefusal | None:
        """A request proven to come from ``peer``."""
        return self.peers.take(peer)

    def charge_body(self, peer: str, host: str, num_units: float) -> None:
        """``peer`` at ``host`` sent a body worth ``num_units`` requests more (see
        :meth:`RateShares.charge`)."""
        if num_units <= 0:
            return
        self.peers.charge(peer, num_units)
        if host:
            self.addresses.charge(address_key(host), num_units)

    def drain(self, peer: str) -> int:
        """``peer`` was refused deeper in for a share it holds (e.g. of the signature checks):
        its bucket is emptied, so that a retry at once is refused at the door, and one that
        ignores the ``Retry-After`` is held. The address's bucket is left alone: the other peers
        behind it did nothing. Returns the ``Retry-After`` to tell."""
        return self.peers.drain(peer)
