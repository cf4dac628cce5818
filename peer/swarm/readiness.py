"""Ready? and behind?: what the collaborative optimizer decides from the swarm's estimate.

At every check (:mod:`peer.swarm.estimate_gate` says when) the optimizer
(:mod:`peer.swarm.optimizer`) reads the swarm's estimate and asks :class:`Readiness` whether to
load the swarm's state (the swarm has left this peer's epoch) or to end the epoch now. Both
answers count who else is at this peer's epoch, which the round then reads too: a peer alone
there skips matchmaking, and one that joined its round late looks for the others' group anyway.
"""

from __future__ import annotations

import math
import time

from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.progress import GlobalProgress
from peer.swarm.split_hold import SplitHold


class Readiness:
    """Whether a peer's epoch ends now or the swarm left it behind, and who is at its epoch.

    Args:
        overlaps: whether rounds run in the background while the next epoch computes
            (``delay_update`` or ``diloco_overlap``).
        newcomer_hold: when alone at its epoch, hold the boundary for a peer catching up
            (:mod:`peer.swarm.newcomer_hold`); None never holds.
        min_round_interval_s: see ``CollaborativeConfig.min_round_interval_s`` (:meth:`pace_s`).
        split_hold: when ahead of most of the swarm, hold the boundary until they arrive
            (:mod:`peer.swarm.split_hold`); None never holds.

    Attributes:
        num_at_epoch: the peers at this peer's epoch by the estimate counted last (itself
            included).
        alone: whether nobody else is at this peer's epoch.
        late_epoch: the epoch whose round this peer joined late (see :meth:`behind`); -1 none.
    """

    def __init__(
        self,
        *,
        overlaps: bool,
        newcomer_hold: NewcomerHold | None,
        min_round_interval_s: float = 0.0,
        split_hold: SplitHold | None = None,
    ):
        self._overlaps = overlaps
        self._newcomer_hold = newcomer_hold
        self._split_hold = split_hold
        self._min_round_interval_s = min_round_interval_s
        self._round_due_s = -math.inf  # no round with others starts sooner
        self.alone = False
        self.late_epoch = -1
        self.num_at_epoch = 1

    def round_ended(self) -> None:
        """This peer's round just ended (or began in the background): the pace counts from
        here, so that partners, whose rounds end together, start the next together."""
        self._round_due_s = time.monotonic() + self._min_round_interval_s

    def pace_s(self) -> float:
        """Seconds to gather on before a round with others may start (0: now), once
        :meth:`ready` said yes. A round sends each partner a few requests; rounds back to back
        at a one-batch target passed the share each peer's server grants another."""
        return 0.0 if self.alone else max(0.0, self._round_due_s - time.monotonic())

    def behind(self, swarm: GlobalProgress, epoch: int) -> bool:
        """Whether to load the swarm's state: more than one epoch behind, or one behind with
        nobody left at this epoch (its round is over; stepping alone would leave this peer's
        parameters apart from everyone's for good in ``grad`` mode). One behind with others
        here: finish the epoch with them (see :meth:`ready`)."""
        if swarm.epoch <= epoch:
            return False
        if swarm.epoch > epoch + 1:
            return True
        self.count_at(swarm, epoch)
        if self.alone and self._overlaps and self.late_epoch != epoch:
            # rounds run in the background: the peers one epoch ahead entered it as their
            # round of this one began, and may still be looking for this peer (once per epoch)
            self.late_epoch = epoch
            return False
        return self.alone

    def joined_late(self, epoch: int) -> bool:
        """Whether this peer, alone at ``epoch``, joins the round of ``epoch`` late: the
        others' records have left it, their round in the background maybe not yet (see
        :meth:`behind`)."""
        return self.alone and self.late_epoch == epoch

    def ready(
        self, swarm: GlobalProgress, epoch: int, samples: int, batch_samples: int = 0
    ) -> bool:
        """Whether to end ``epoch`` now, with ``samples`` gathered: the swarm reached its
        target, or will be nearer to it now than after this peer's next local step (half a
        step's worth of the swarm's samples is missing at most), so that epochs hold the target
        on average."""
        self.count_at(swarm, epoch)
        if swarm.epoch > epoch:
            return True  # the swarm moved on: average what we have, or fall back and resync
        if swarm.ready and self.alone and self._newcomer_hold is not None:
            if self._newcomer_hold.should_hold(swarm, epoch):
                return False
        if swarm.ready or self.alone or samples == 0:
            ready = swarm.ready
        else:
            ready = swarm.eta_next_epoch_s <= 0.5 * local_step_s(swarm, batch_samples)
        if ready and self._split_hold is not None:
            return not self._split_hold.should_hold(swarm, epoch)
        return ready

    def count_at(self, swarm: GlobalProgress, epoch: int) -> None:
        """Count the peers at ``epoch`` by ``swarm``'s estimate."""
        # nobody else at this epoch: a round would only wait out matchmaking for a group of one
        # (``num_at`` scales a large swarm's sample of records up to the whole swarm)
        self.num_at_epoch = swarm.num_at(epoch)
        self.alone = self.num_at_epoch <= 1


def local_step_s(swarm: GlobalProgress, batch_samples: int) -> float:
    """Seconds of one local step of ``batch_samples`` at this peer's own rate (0 when
    unknown)."""
    own_rate = swarm.peers[0].samples_per_s if swarm.peers else 0.0
    return batch_samples / own_rate if own_rate > 0 else 0.0
