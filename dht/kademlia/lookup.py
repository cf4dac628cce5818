"""Kademlia's iterative lookup: alpha requests in flight, converging on the k closest nodes.

The lookup keeps ``alpha`` requests in flight to the closest nodes not yet asked, and stops when
the k closest nodes that answered are closer than every node left to ask. Each node learned is
one hop deeper than the node that named it (the nodes of the own routing table are hop 1), so a
lookup reports how long a chain of nodes it had to follow.

A store runs two lookups: finds until the few closest nodes answered (the neighbourhood of the
key is known by then), then stores sent to all of the k closest seen at once, whose answers name
their closest nodes too, so the second lookup converges on the k closest exactly as a find would,
and every one of them holds the value. That spares a full round of finds before the stores.
The price: when a store answer names a closer node nobody had mentioned, the node it displaces
from the k closest keeps a copy too (a stray just beyond the k closest, which expires as usual).
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dht.kademlia.messages import FindAnswer
from dht.kademlia.routing import PeerInfo
from dht.kademlia.storage import Entry, merge_entries

FindFn = Callable[[PeerInfo], Awaitable[FindAnswer | None]]


@dataclass(frozen=True)
class LookupResult:
    """What one lookup found.

    Attributes:
        nearest: up to k nodes that answered, closest to the target first.
        candidates: up to k nodes closest to the target among those that answered and those
            seen but not asked (a lookup that converged early did not ask them all).
        entry: the value records found, merged across every node that answered with one.
        hops: depth of the node chain: the hop of the first node that answered with a value,
            or (no value) of the closest node that answered; 0 if no node answered.
        num_queried: how many requests the lookup sent.
        num_failed: how many of them failed (those nodes were dropped from routing).
        timed_out: the lookup reached its deadline before it converged.
    """

    nearest: list[PeerInfo]
    candidates: list[PeerInfo]
    entry: Entry | None
    hops: int
    num_queried: int
    num_failed: int
    timed_out: bool = False


async def iterative_find(
    target: int,
    initial: list[PeerInfo],
    find: FindFn,
    *,
    own_id: int,
    k: int,
    alpha: int,
    stop_on_value: bool,
    converge_on: int | None = None,
    timeout_s: float = float("inf"),
) -> LookupResult:
    """Look up ``target`` starting from ``initial`` nodes (usually the own closest known).

    Args:
        target: the id looked up.
        initial: the nodes to start from.
        find: asks one node; returns None when it failed.
        own_id: this node's id (never asked).
        k: how many closest nodes to converge on.
        alpha: how many requests to keep in flight.
        stop_on_value: return as soon as any node answers with a value.
        converge_on: stop once this many closest nodes answered (default: k) and no node left
            to ask is closer.
        timeout_s: bound on the whole lookup, in seconds: at the deadline the requests in
            flight are cancelled and the lookup returns what it found (strangers naming
            endless unreachable nodes cannot hold it for longer).
    """
    lookup = _Lookup(target, own_id, k, k if converge_on is None else min(converge_on, k))
    lookup.learn(initial, hop=1)
    in_flight: dict[asyncio.Task, tuple[int, int, PeerInfo]] = {}  # -> (distance, hop, peer)
    deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s < float("inf") else None
    try:
        async with asyncio.timeout_at(deadline):
            await _run(lookup, find, in_flight, alpha, stop_on_value)
    except TimeoutError:
        lookup.timed_out = True
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
    return lookup.result()


async def _run(lookup: _Lookup, find: FindFn, in_flight: dict, alpha: int, stop_on_value: bool):
    while True:
        while len(in_flight) < alpha:
            item = lookup.next_to_ask(in_flight.values())
            if item is None:
                break
            in_flight[asyncio.create_task(find(item[2]))] = item
        if not in_flight:
            return
        done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            lookup.absorb(in_flight.pop(task), task.result())
        if lookup.entry is not None and stop_on_value:
            return


class _Lookup:
    """The state of one lookup: who is known, asked and answered, and what was found."""

    def __init__(self, target: int, own_id: int, k: int, converge_on: int):
        self.target = target
        self.k = k
        self.converge_on = converge_on
        self.seen = {own_id}
        self.to_ask: list[tuple[int, int, PeerInfo]] = []  # (distance, hop, peer), a heap
        self.answered: list[tuple[int, int, PeerInfo]] = []  # sorted by distance, at most k
        self.entry: Entry | None = None
        self.value_hop = 0
        self.num_queried = 0
        self.num_failed = 0
        self.timed_out = False

    def learn(self, peers: list[PeerInfo], hop: int) -> None:
        for peer in peers:
            if peer.node_id not in self.seen:
                self.seen.add(peer.node_id)
                heapq.heappush(self.to_ask, (peer.node_id ^ self.target, hop, peer))

    def next_to_ask(self, in_flight) -> tuple[int, int, PeerInfo] | None:
        """The closest node not asked yet, unless enough closer nodes answered or may answer.

        Requests in flight count as answers to come: asking a farther node before they fail
        would only reach a node that cannot end among the closest (and, for a store, leave a
        stray copy there).
        """
        if not self.to_ask:
            return None
        distance = self.to_ask[0][0]
        num_closer = bisect.bisect_left([d for d, _, _ in self.answered], distance)
        num_closer += sum(1 for d, _, _ in in_flight if d < distance)
        if num_closer >= self.converge_on:
            return None  # a heap: everything left is farther still
        self.num_queried += 1
        return heapq.heappop(self.to_ask)

    def absorb(self, item: tuple[int, int, PeerInfo], answer: FindAnswer | None) -> None:
        if answer is None:
            self.num_failed += 1
            return
        index = bisect.bisect_left([d for d, _, _ in self.answered], item[0])
        self.answered.insert(index, item)
        del self.answered[self.k :]
        hop = item[1]
        if answer.entry is not None:
            self.value_hop = self.value_hop or hop
            self.entry = merge_entries(self.entry, answer.entry)
        self.learn(answer.peers, hop + 1)

    def result(self) -> LookupResult:
        answered = self.answered
        candidates = heapq.nsmallest(self.k, answered + self.to_ask, key=lambda item: item[0])
        return LookupResult(
            nearest=[p for _, _, p in answered],
            candidates=[p for _, _, p in candidates],
            entry=self.entry,
            hops=self.value_hop or (answered[0][1] if answered else 0),
            num_queried=self.num_queried,
            num_failed=self.num_failed,
            timed_out=self.timed_out,
        )
