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
import math
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


class Slot:
    """One slot of a :class:`FairSlots` pool, held by one request (or tunnel) of ``key``.

    Attributes:
        key: the address key (or peer id) it is charged to.
        evicted: set when a newcomer took it (its holder must stop: see :meth:`FairSlots.take`).
        holder: whatever its owner needs to stop it when it is evicted (set by the owner).
    """

    __slots__ = ("evicted", "holder", "key")

    def __init__(self, key: str):
        self.key = key
        self.evicted = False
        self.holder: object = None


class FairSlots:
    """A fixed number of slots, shared fairly by the keys (addresses) holding or asking for them.

    While a slot is free, a key may take one up to ``max_per_key``. When none is free (the pool
    is contended), a key's fair share is ``max(1, capacity / n)``, where ``n`` counts the keys
    holding slots and the key asking: a key that holds fewer than its share (rounded up) takes
    the oldest slot of the key holding the most, if that key holds more than its share and at
    least two more than the asker (so two keys never take a slot back and forth). So a key that
    holds none always gets one while another key holds more than its share, and a key is
    refused only when it holds its share or every holder is within its own. Each decision is
    O(number of keys holding slots).

    Args:
        capacity: slots in all.
        max_per_key: the most slots one key holds, even when some are free.
        unit: what a slot is, for the refusals' reasons.
    """

    def __init__(self, *, capacity: int, max_per_key: int, unit: str = "slots"):
        if capacity < 1 or max_per_key < 1:
            raise ValueError(f"capacity and max_per_key must be >= 1: {capacity}, {max_per_key}")
        self.capacity = capacity
        self.max_per_key = max_per_key
        self.unit = unit
        self.num_held = 0
        # key -> its slots, oldest first (a dict keeps insertion order; removal is O(1))
        self._held: dict[str, dict[Slot, None]] = {}

    def held_by(self, key: str) -> int:
        return len(self._held.get(key, ()))

    @property
    def num_keys(self) -> int:
        """Keys holding at least one slot."""
        return len(self._held)

    def fair_share(self, key: str) -> float:
        """``key``'s share of a contended pool: ``max(1, capacity / n)``, ``n`` the keys
        holding slots and ``key``."""
        num_keys = len(self._held) + (key not in self._held)
        return max(1.0, self.capacity / num_keys)

    def can_take(self, key: str) -> bool:
        """Whether :meth:`take` would give ``key`` a slot now (it changes nothing)."""
        try:
            self._victim_key(key)
        except OverShare:
            return False
        return True

    def take(self, key: str) -> tuple[Slot, Slot | None]:
        """A slot for ``key``, and the slot it was taken from (evicted: its owner must be
        stopped by the caller, at once), if none was free.

        Raises:
            OverShare: ``key`` holds ``max_per_key``, or the pool is full and ``key`` holds its
                fair share or nobody holds more than theirs.
        """
        victim_key = self._victim_key(key)
        victim = None
        if victim_key is not None:
            victim = next(iter(self._held[victim_key]))  # the oldest: held the longest
            self.release(victim)
            victim.evicted = True
        slot = Slot(key)
        self._held.setdefault(key, {})[slot] = None
        self.num_held += 1
        return slot, victim

    def _victim_key(self, key: str) -> str | None:
        """The key to take a slot from for ``key`` (None: one is free); raises OverShare."""
        held = self.held_by(key)
        if held >= self.max_per_key:
            raise OverShare(f"this address holds {held} {self.unit}, its most")
        if self.num_held < self.capacity:
            return None
        share = self.fair_share(key)
        if held + 1 > math.ceil(share):
            raise OverShare(
                f"all {self.capacity} {self.unit} are in use and this address holds {held}, "
                f"its fair share of {share:.1f}"
            )
        most_key = max(self._held, key=lambda k: len(self._held[k]))
        most = len(self._held[most_key])
        if most <= share or most < held + 2:
            raise OverShare(
                f"all {self.capacity} {self.unit} are in use, each address within its fair "
                f"share of {share:.1f}"
            )
        return most_key

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back (a no-op if it was evicted or given back already)."""
        slots = self._held.get(slot.key)
        if slots is None or slot not in slots:
            return
        del slots[slot]
        self.num_held -= 1
        if not slots:
            del self._held[slot.key]
