"""The collaborative optimizer's averager: a DecentralizedAverager on the peer's loop thread,
reached from the training thread through a blocking call that marks the profiler's phases (or,
for delayed updates, a round started in the background and collected later)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

import torch

from averaging.averager import DecentralizedAverager
from averaging.errors import AveragingError, translate
from dht.errors import DHTError
from dht.runtime import EventLoopThread
from peer.profiling.phases import PhaseClock
from peer.swarm.round import RoundOutcome

# How much longer than the round's own bound the training thread waits for it.
FACADE_SLACK_S = 5.0


class SwarmAverager:
    """:class:`peer.swarm.optimizer.TensorAverager` over a :class:`DecentralizedAverager`.

    The averager was built over the optimizer's fixed buffers, so ``tensors`` must be those.
    The blocking call is charged to ``matchmaking``; the all-reduce's share, which the
    averager reports when it returns, then moves to ``allreduce``.
    """

    def __init__(
        self, averager: DecentralizedAverager, loop_thread: EventLoopThread, clock: PhaseClock
    ):
        self.averager = averager
        self.loop_thread = loop_thread
        self.clock = clock
        self.last_result = None

    def _group_size(self, expected_peers: int) -> int:
        # the peers known to be at this epoch: a leader closes once they are all in
        config = self.averager.config
        return max(config.min_group_size, min(expected_peers, config.target_group_size))

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: int,
    ) -> RoundOutcome:
        with self.clock.phase("matchmaking"):
            try:
                result = self.averager.step_blocking(
                    self.loop_thread,
                    weight,
                    epoch=epoch,
                    timeout_s=timeout_s,
                    target_group_size=self._group_size(expected_peers),
                )
            except AveragingError as e:
                reason = str(e) or type(e).__name__
                return RoundOutcome(
                    ok=False, num_peers=1, reason=reason, epoch=epoch, status="failed"
                )
        self.clock.transfer(result.allreduce_s, "matchmaking", "allreduce")
        return self._outcome(result, epoch)

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
        step = self.averager.step(
            weight,
            epoch=epoch,
            timeout_s=timeout_s,
            target_group_size=self._group_size(expected_peers),
        )
        future = self.loop_thread.submit(asyncio.wait_for(step, timeout_s + FACADE_SLACK_S))
        return PendingRound(self, future, epoch)

    def _outcome(self, result, epoch: int) -> RoundOutcome:
        self.last_result = result
        return RoundOutcome(
            ok=result.status in ("ok", "partial", "alone"),
            num_peers=max(1, len(result.members)),
            reason=result.reason,
            matchmaking_s=result.matchmaking_s,
            allreduce_s=result.allreduce_s,
            # the members whose values are in the average: a dropped one is nobody's partner
            members=tuple(m for m in result.members if m not in result.dropped_peers),
            epoch=epoch,
            status=result.status,
            sent_bytes=result.bytes_sent,
            recv_bytes=result.bytes_received,
            num_dropped=len(result.dropped_peers),
            averaged_fraction=result.averaged_fraction,
        )


class PendingRound:
    """A round running on the loop thread while the training thread goes on."""

    def __init__(self, owner: SwarmAverager, future: concurrent.futures.Future, epoch: int):
        self._owner = owner
        self._future = future
        self._epoch = epoch

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> RoundOutcome:
        """The round's outcome; the time spent waiting for it is charged to ``allreduce``."""
        with self._owner.clock.phase("allreduce"):
            try:
                result = self._future.result()
            except TimeoutError:
                return self._failed("the round timed out")
            except AveragingError as e:
                return self._failed(str(e) or type(e).__name__)
            except DHTError as e:
                return self._failed(str(translate(e)))
        return self._owner._outcome(result, self._epoch)

    def _failed(self, reason: str) -> RoundOutcome:
        return RoundOutcome(
            ok=False, num_peers=1, reason=reason, epoch=self._epoch, status="failed"
        )

    def cancel(self) -> None:
        self._future.cancel()
