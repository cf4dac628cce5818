"""CPU work a node does for others (signature checks), off the event loop and shared fairly.

A store request of 64 records signed under owner subkeys costs 64 Ed25519 verifications (about
8 ms); done on the event loop, a peer sending such requests as fast as it can stalls every other
peer's RPCs and streams. Here the work runs in one worker thread, one job at a time, in turns:
round robin over source addresses (an IPv6 /64 counts as one), and within an address over proven
peers, so a peer waits behind at most one job of each other holder, however much another queued.
What each holder may have queued is a share (:class:`dht.net.shares.FairBudget`): past it the
job is refused at once (:class:`dht.net.shares.OverShare`), not queued.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, TypeVar

from dht.net.shares import FairBudget, address_key

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
    """

    def __init__(
        self, *, max_units: int, max_units_per_peer: int, max_units_per_address: int, unit: str
    ):
        self.budget = FairBudget(
            max_total=max_units,
            max_per_peer=max_units_per_peer,
            max_per_address=max_units_per_address,
            unit=unit,
        )
        # address key -> peer -> its jobs; both levels in turn order (the next at the front)
        self._turns: OrderedDict[str, OrderedDict[str, deque[_Job]]] = OrderedDict()
        self._worker: asyncio.Task | None = None
        self._closed = False
        self.num_jobs_done = 0

    async def run(self, peer: str, host: str, units: int, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in the worker thread in ``peer``'s turn and return what it returns.

        Args:
            peer: the proven peer id the work is for ("" for none).
            host: its source IP ("" when unknown, e.g. relayed).
            units: what the job costs (e.g. its signatures to check), held until it is done.
            fn: the work; it runs in another thread, so it must be thread-safe.

        Raises:
            OverShare: ``units`` do not fit in the holder's share or the pool.
            RuntimeError: :meth:`close` was called.
        """
        if self._closed:
            raise RuntimeError("this work queue is closed")
        with self.budget.account(peer, host) as account:
            account.charge(units)
            future = asyncio.get_running_loop().create_future()
            address = address_key(host)
            peers = self._turns.setdefault(address, OrderedDict())
            peers.setdefault(peer, deque()).append(_Job(fn, future))
            if self._worker is None or self._worker.done():
                self._worker = asyncio.create_task(self._work(), name="fair-work")
            return await future  # a caller that gives up cancels it: the worker skips it

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
