"""CPU work a node does for others (signature checks), off the event loop and shared fairly.

A store request of 64 records signed under owner subkeys costs 64 Ed25519 verifications (about
8 ms); done on the event loop, a peer sending such requests as fast as it can stalls every other
peer's RPCs and streams. Here the work runs in one worker thread, one job at a time, in turns:
round robin over source addresses (an IPv6 /64 counts as one), and within an address over proven
peers, so a peer waits behind at most one job of each other holder, however much another queued.
What each holder may have queued is a share (:class:`dht.net.shares.FairBudget`): past it the
job is refused at once (:class:`dht.net.shares.OverShare`), not queued. And what each holder may
have done per second is a share too (a token bucket per peer and per address): turns are fair
among those that wait, but a lone flooder would otherwise keep the worker (a whole core, which
the event loop and every other process of the host need) busy for as long as it likes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, TypeVar

from dht.net.request_shares import TokenBuckets
from dht.net.shares import FairBudget, OverShare, address_key

T = TypeVar("T")


class _Job:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any], future: asyncio.Future):
        self.fn = fn
        self.future = future


class FairWork:
    """Jobs run in a worker thread in turns per source address, then per peer.

    Args:
        max_units: the most units (e.g. signatures to check) queued or running, in all.
        max_units_per_peer: the share of one proven peer id.
        max_units_per_address: the share of one source address ("" is unknown: not counted).
        unit: what a unit is, for refusals.
        max_units_per_s_per_peer: units one proven peer id may have done per second (bursts
            of a second's worth, at least its queue share); None: no rate share.
        max_units_per_s_per_address: the same for one source address (an IPv6 /64).
    """

    def __init__(
        self,
        *,
        max_units: int,
        max_units_per_peer: int,
        max_units_per_address: int,
        unit: str,
        max_units_per_s_per_peer: float | None = None,
        max_units_per_s_per_address: float | None = None,
    ):
        self.budget = FairBudget(
            max_total=max_units,
            max_per_peer=max_units_per_peer,
            max_per_address=max_units_per_address,
            unit=unit,
        )
        self.unit = unit
        self._peer_rate = _rate(max_units_per_s_per_peer, max_units_per_peer)
        self._address_rate = _rate(max_units_per_s_per_address, max_units_per_address)
        # address key -> peer -> its jobs; both levels in turn order (the next at the front)
        self._turns: OrderedDict[str, OrderedDict[str, deque[_Job]]] = OrderedDict()
        self._worker: asyncio.Task | None = None
        self._closed = False
        self.num_jobs_done = 0

    async def run(
        self, peer: str, host: str, units: int, fn: Callable[[], T], *, rated: bool = True
    ) -> T:
        """Run ``fn()`` in the worker thread in ``peer``'s turn and return what it returns.

        Args:
            peer: the proven peer id the work is for ("" for none).
            host: its source IP ("" when unknown, e.g. relayed).
            units: what the job costs (e.g. its signatures to check), held until it is done.
            fn: the work; it runs in another thread, so it must be thread-safe.
            rated: charge the holder's rate share (False for work this node asked for, such as
                checking the answers to its own lookups: only the queue share applies).

        Raises:
            OverShare: ``units`` do not fit in the holder's share or the pool, or in what it may
                have done this second.
            RuntimeError: :meth:`close` was called.
        """
        if self._closed:
            raise RuntimeError("this work queue is closed")
        if rated:
            self._take_rate(peer, host, units)
        with self.budget.account(peer, host) as account:
            account.charge(units)
            future = asyncio.get_running_loop().create_future()
            address = address_key(host)
            peers = self._turns.setdefault(address, OrderedDict())
            peers.setdefault(peer, deque()).append(_Job(fn, future))
            if self._worker is None or self._worker.done():
                self._worker = asyncio.create_task(self._work(), name="fair-work")
            return await future  # a caller that gives up cancels it: the worker skips it

    def _take_rate(self, peer: str, host: str, units: int) -> None:
        for buckets, key, holder in (
            (self._peer_rate, peer, "peer"),
            (self._address_rate, address_key(host), "address"),
        ):
            if buckets is None or not key:
                continue
            wait_s = buckets.shortfall_s(key, units)
            if wait_s > 0:
                raise OverShare(
                    f"this {holder}'s share of {buckets.rate_per_s:g} {self.unit} a second is "
                    f"spent; retry in {min(wait_s, 3600.0):.2f} s"
                )

    def is_full_for(self, peer: str, host: str) -> bool:
        """Whether ``peer`` at ``host`` could queue nothing now (a cheap check, so that a
        holder at its share is refused before its request is even parsed)."""
        budget = self.budget
        return (
            budget.in_use >= budget.max_total
            or (bool(peer) and budget.held_by_peer(peer) >= budget.max_per_peer)
            or (bool(host) and budget.held_by_address(host) >= budget.max_per_address)
        )

    def _next(self) -> _Job | None:
        while self._turns:
            address, peers = next(iter(self._turns.items()))
            self._turns.move_to_end(address)
            peer, jobs = next(iter(peers.items()))
            peers.move_to_end(peer)
            job = jobs.popleft()
            if not jobs:
                del peers[peer]
            if not peers:
                del self._turns[address]
            if not job.future.done():
                return job
        return None

    async def _work(self) -> None:
        while (job := self._next()) is not None:
            try:
                result = await asyncio.to_thread(job.fn)
            except asyncio.CancelledError:
                if not job.future.done():
                    job.future.cancel()
                raise
            except Exception as e:  # the job's own failure belongs to its caller
                if not job.future.done():
                    job.future.set_exception(e)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            self.num_jobs_done += 1

    async def close(self) -> None:
        """Cancel the queued jobs and the worker; safe twice."""
        self._closed = True
        for peers in self._turns.values():
            for jobs in peers.values():
                for job in jobs:
                    job.future.cancel()
        self._turns.clear()
        worker, self._worker = self._worker, None
        if worker is not None and not worker.done():
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)


def _rate(units_per_s: float | None, queue_share: int) -> TokenBuckets | None:
    if units_per_s is None:
        return None
    return TokenBuckets(rate_per_s=units_per_s, burst=max(units_per_s, queue_share))
