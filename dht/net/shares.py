"""Fair shares of a pool a node keeps for others: per proven peer and per source address.

A pool that the whole node shares (bytes of bodies being received, relayed bytes, slots) is one
decision that a single key or address could otherwise take all of. Here each holder is charged
for what actually arrived (never for what it announced), and may hold at most its share: one
peer id at most ``max_per_peer``, one source address (an IPv6 /64 counts as one address) at most
``max_per_address``, everyone together at most ``max_total``. What a holder took is given back
at once when its :class:`Account` closes (the request ended, was refused or stalled).
"""

from __future__ import annotations

import ipaddress
from collections import Counter

# The address shares' key of a caller reached through this node's relay tunnel, before the
# address its relay passed (see dht.net.door.Door.share_host).
RELAYED_SHARE_PREFIX = "relayed/"


def same_source(key: str, other: str) -> bool:
    """Whether two address keys name the same address, one of them as a relay passed it (a
    swarm on one host, some of it relayed, is one address, not two that contend)."""
    return key.removeprefix(RELAYED_SHARE_PREFIX) == other.removeprefix(RELAYED_SHARE_PREFIX)


def address_key(host: str) -> str:
    """The key a source address is counted under: the IPv4 address, or the /64 of an IPv6 one
    (one subscriber usually holds a whole /64); "" (unknown, e.g. relayed) stays ""."""
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class OverShare(Exception):
    """A charge did not fit in the holder's share or in the pool."""


class FairBudget:
    """A pool of units (bytes) with a share per peer id and per source address.

    Args:
        max_total: the most units held by everyone together.
        max_per_peer: the most held under one proven peer id ("" is no id: not counted).
        max_per_address: the most held under one address key ("" is unknown: not counted).
        unit: what is counted, for the refusal's reason.
    """

    def __init__(self, *, max_total: int, max_per_peer: int, max_per_address: int, unit="bytes"):
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.max_per_address = max_per_address
        self.unit = unit
        self.in_use = 0
        self._per_peer: Counter[str] = Counter()
        self._per_address: Counter[str] = Counter()

    def account(self, peer: str, host: str) -> Account:
        """An account of ``peer`` at ``host`` (a raw source IP) to charge while receiving; use
        it in a ``with`` block, which gives everything charged back on exit."""
        return Account(self, peer, address_key(host))

    def held_by_peer(self, peer: str) -> int:
        return self._per_peer.get(peer, 0)

    def held_by_address(self, host: str) -> int:
        return self._per_address.get(address_key(host), 0)

    def _charge(self, peer: str, address: str, amount: int) -> None:
        if self.in_use + amount > self.max_total:
            raise OverShare(f"{self.in_use} of {self.max_total} {self.unit} in use")
        if peer and self._per_peer[peer] + amount > self.max_per_peer:
            raise OverShare(f"this peer holds its share of {self.max_per_peer} {self.unit}")
        if address and self._per_address[address] + amount > self.max_per_address:
            raise OverShare(f"this address holds its share of {self.max_per_address} {self.unit}")
        self.in_use += amount
        if peer:
            self._per_peer[peer] += amount
        if address:
            self._per_address[address] += amount

    def _release(self, peer: str, address: str, amount: int) -> None:
        self.in_use -= amount
        for counter, key in ((self._per_peer, peer), (self._per_address, address)):
            if key:
                counter[key] -= amount
                if counter[key] <= 0:
                    del counter[key]


class Account:
    """What one request holds of a :class:`FairBudget`."""

    __slots__ = ("_address", "_budget", "_peer", "held")

    def __init__(self, budget: FairBudget, peer: str, address: str):
        self._budget = budget
        self._peer = peer
        self._address = address
        self.held = 0

    def charge(self, amount: int) -> None:
        """Take ``amount`` more (units that arrived); raises :class:`OverShare` if it does not
        fit, holding what it held before."""
        if amount > 0:
            self._budget._charge(self._peer, self._address, amount)
            self.held += amount

    def close(self) -> None:
        """Give back everything held (safe twice)."""
        if self.held:
            self._budget._release(self._peer, self._address, self.held)
            self.held = 0

    def __enter__(self) -> Account:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
