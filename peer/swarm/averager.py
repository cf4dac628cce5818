"""The collaborative optimizer's averager: a DecentralizedAverager on the peer's loop thread,
reached from the training thread through a blocking call that marks the profiler's phases (or,
for delayed updates, a round started in the background and collected later)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

import torch

from averaging.averager import DecentralizedAverager
from averaging.errors import AveragingError, translate
from averaging.result import RoundResult
from dht.errors import DHTError
from dht.runtime import EventLoopThread
from peer.profiling.phases import PhaseClock
from peer.swarm.moved_on import stop_when_moved_on
from peer.swarm.round import failed

# How much longer than the round's own bound the training thread waits for it.
FACADE_SLACK_S = 5.0


class SwarmAverager:
    """:class:`peer.swarm.optimizer.TensorAverager` over a :class:`DecentralizedAverager`.

    The averager was built over the optimizer's fixed buffers, so ``tensors`` must be those.
    The blocking call is charged to ``matchmaking``; the all-reduce's share, which the
    averager reports when it returns, then moves to ``allreduce``. ``expected_peers`` (the
    peers known to be at this epoch) goes to the averager: one group when they fit in one,
    else balanced rows whose means are averaged again so that every row ends with the same
    model (:mod:`averaging.levels`). ``moved_on`` (the swarm's epoch once it has left the
    round's epoch for good, else None) ends a search for a group as soon as it says so: an
    "alone" result whose reason starts with :data:`peer.swarm.moved_on.MOVED_ON` (nobody is
    coming).
    """

    def __init__(
        self, averager: DecentralizedAverager, loop_thread: EventLoopThread, clock: PhaseClock
    ):
        self.averager = averager
        self.loop_thread = loop_thread
        self.clock = clock

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.averager.tensors) or any(
            a is not b for a, b in zip(tensors, self.averager.tensors, strict=False)
        ):
            raise ValueError("the averager averages the buffers it was built over, not these")

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
        moved_on: Callable[[], int | None] | None = None,
    ) -> RoundResult:
        self._check(tensors)
        with self.clock.phase("matchmaking"):
            try:
                result = self.averager.step_blocking(
                    self.loop_thread,
                    weight,
                    epoch=epoch,
                    timeout_s=timeout_s,
                    expected_peers=max(1, expected_peers),
                    stop_when=None if moved_on is None else stop_when_moved_on(moved_on),
                )
            except AveragingError as e:
                return failed(epoch, str(e) or type(e).__name__)
        self.clock.transfer(result.allreduce_s, "matchmaking", "allreduce")
        return dataclasses.replace(result, epoch=epoch)

    def start_average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
    ) -> PendingRound:
        """Start a round in the background; the tensors must stay untouched until it ends."""
        self._check(tensors)
        step = self.averager.step(
            weight,
            epoch=epoch,
            timeout_s=timeout_s,
            expected_peers=max(1, expected_peers),
        )
        future = self.loop_thread.submit(asyncio.wait_for(step, timeout_s + FACADE_SLACK_S))
        return PendingRound(self, future, epoch)


class PendingRound:
    """A round running on the loop thread while the training thread goes on."""

    def __init__(self, owner: SwarmAverager, future: concurrent.futures.Future, epoch: int):
        self._owner = owner
        self._future = future
        self._epoch = epoch

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> RoundResult:
        """The round's outcome; the time spent waiting for it is charged to ``allreduce``."""
        with self._owner.clock.phase("allreduce"):
            try:
                result = self._future.result()
            except TimeoutError:
                return failed(self._epoch, "the round timed out")
            except AveragingError as e:
                return failed(self._epoch, str(e) or type(e).__name__)
            except DHTError as e:
                return failed(self._epoch, str(translate(e)))
        return dataclasses.replace(result, epoch=self._epoch)
