"""The collaborative optimizer's averager: a DecentralizedAverager on the peer's loop thread,
reached from the training thread through a blocking call that marks the profiler's phases."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from averaging.averager import DecentralizedAverager
from averaging.errors import AveragingError
from dht.runtime import EventLoopThread
from peer.collaborative import RoundOutcome
from peer.phases import PhaseClock


class SwarmAverager:
    """:class:`peer.collaborative.TensorAverager` over a :class:`DecentralizedAverager`.

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
                config = self.averager.config
                result = self.averager.step_blocking(
                    self.loop_thread,
                    weight,
                    epoch=epoch,
                    timeout_s=timeout_s,
                    # the peers known to be at this epoch: a leader closes once they are all in
                    target_group_size=max(
                        config.min_group_size, min(expected_peers, config.target_group_size)
                    ),
                )
            except AveragingError as e:
                return RoundOutcome(ok=False, num_peers=1, reason=str(e) or type(e).__name__)
        self.clock.transfer(result.allreduce_s, "matchmaking", "allreduce")
        self.last_result = result
        ok = result.status in ("ok", "partial", "alone")
        return RoundOutcome(
            ok=ok,
            num_peers=max(1, len(result.members)),
            reason=result.reason,
            matchmaking_s=result.matchmaking_s,
            allreduce_s=result.allreduce_s,
            members=tuple(result.members),
        )
