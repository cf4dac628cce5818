"""The collaborative optimizer: a :class:`peer.train.trainer.StepHook` that turns local steps into
swarm epochs.

Modes (``CollaborativeConfig.mode``):

* ``grad``: gradients accumulate locally, weighted by batch size; when the swarm has gathered
  ``target_batch_size`` samples, the peers average their mean gradients weighted by the samples
  each contributed (so the result is the gradient of the union of everyone's batches), the local
  optimizer steps once, and the epoch advances. Exact while no member brought more than
  ``max_weight_ratio`` (8) times the group's lower median of samples: beyond it the weight is
  capped (:mod:`averaging.bounds`, against a member claiming a huge one), so the batches of a
  peer that entered the epoch late with a few samples weigh a little more than in the union.
* ``params``: the optimizer steps on every local batch; at each epoch boundary the parameters
  are averaged (weighted by samples).
* ``grad`` with ``delay_update``: the round of epoch t runs in the background while the peer
  computes epoch t+1 (on the parameters before t's step); the averaged gradient is applied as
  soon as the round ends, mid-epoch. Staleness: at most one optimizer step, as in hivemind's
  delayed parameter updates; the all-reduce costs no compute time unless it takes longer than
  an epoch (then the next boundary waits for it, charged to ``allreduce``). The state of epoch
  t+1 (served, digested, re-synced to: :class:`peer.swarm.epoch.Epoch`) is the one after that
  step, taken when it lands.
* ``diloco``: the inner optimizer steps locally; at each epoch boundary the peers average the
  pseudo-gradient (parameters at the start of the epoch minus now), parameters go back to the
  start of the epoch, and an outer optimizer (SGD with Nesterov momentum) applies the average.
* ``diloco`` with ``diloco_overlap``: the round of epoch t runs in the background while the
  inner steps of epoch t+1 go on from where epoch t ended; its average is applied when the round
  ends (the outer step one round late, the inner progress made meanwhile kept: the update is in
  :mod:`peer.swarm.diloco`). As with ``delay_update``, compute waits only for a round longer
  than an epoch, and the state of epoch t+1 is the replica after round t.

A round that fails (no group, a timeout) is an expected outcome: the peer steps on its own
contribution, counts it and logs one WARNING line; the next parameter sync brings it back in
line. The learning rate follows the swarm's epoch (``lr_schedule``), not local steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from averaging.result import RoundResult
from peer.swarm.contribution import Contribution
from peer.swarm.epoch import Epoch
from peer.swarm.estimate_gate import EstimateGate
from peer.swarm.moved_on import moved_on
from peer.swarm.newcomer_hold import NewcomerHold
from peer.swarm.optimizer_config import CollaborativeConfig, make_contribution
from peer.swarm.progress import GlobalProgress
from peer.swarm.readiness import Readiness, local_step_s
from peer.swarm.round import (
    EpochStats,
    PendingRound,
    ProgressSource,
    StateSource,
    TensorAverager,
    alone,
)
from peer.swarm.split_hold import SplitHold
from peer.swarm.state_resync import Resyncer
from peer.train.trainer import StepContext

logger = logging.getLogger(__name__)
# Rounds a newcomer makes at one epoch boundary while it finds no group (see ``_early``).
MAX_EARLY_ROUNDS = 3


class CollaborativeOptimizer:
    """The hook the trainer calls after every backward pass; see the module docstring.

    One round reads top to bottom in :meth:`on_step` and :meth:`finish_epoch`: accumulate ->
    ready? (:class:`peer.swarm.readiness.Readiness`) -> average -> apply -> next epoch.

    Args:
        model: the model being trained (its parameters are what is averaged).
        optimizer: the local (inner, in ``diloco``) optimizer.
        averager: averages the contribution's buffers with a group of the swarm.
        progress: the progress tracker (reports local samples, estimates the swarm's).
        config: mode, target batch size and timeouts.
        epoch: the peer's epoch (the optimizer moves it; others subscribe); a new one at 0
            when None.
        contribution: the averaged buffers and the mode's arithmetic, when the caller built
            them first (to build the averager over ``contribution.buffers``).
        lr_schedule: epoch -> factor of each param group's base LR (see
            :mod:`peer.train.schedules`), applied whenever the epoch changes; None keeps the LR.
        state: where to get the swarm's state when it is ahead of this peer (None never
            catches up).
        newcomer_hold: when alone at its epoch, hold the boundary for a peer catching up
            (:mod:`peer.swarm.newcomer_hold`); None never holds.
        split_hold: when ahead of most of the swarm, hold the boundary until they arrive
            (:mod:`peer.swarm.split_hold`); None never holds.
        replicas: replaces this peer's replica when it differs from the swarm's agreed one
            (:mod:`peer.swarm.state_resync`); None never re-syncs.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        averager: TensorAverager,
        progress: ProgressSource,
        config: CollaborativeConfig,
        epoch: Epoch | None = None,
        contribution: Contribution | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        state: StateSource | None = None,
        newcomer_hold: NewcomerHold | None = None,
        replicas: Resyncer | None = None,
        split_hold: SplitHold | None = None,
    ):
        self.optimizer = optimizer
        self.averager = averager
        self.progress = progress
        self.config = config
        self.lr_schedule = lr_schedule
        self.state = state
        self.newcomer_hold = newcomer_hold
        self.replicas = replicas
        self.contribution = contribution or make_contribution(model, optimizer, config)
        self.epoch_counter = epoch if epoch is not None else Epoch()
        self.epoch_counter.subscribe(self._entered)
        self.samples = 0  # this peer's samples in the current epoch
        self.stats = EpochStats()
        self._gate = EstimateGate()
        self._readiness = Readiness(
            overlaps=self._overlaps,
            newcomer_hold=newcomer_hold,
            min_round_interval_s=config.min_round_interval_s,
            split_hold=split_hold,
        )
        self._pending: PendingRound | None = None
        self._pending_epoch = 0
        self._clock = None
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self._apply_lr()

    @property
    def epoch(self) -> int:
        """This peer's epoch (read from its one owner, :class:`peer.swarm.epoch.Epoch`)."""
        return self.epoch_counter.value

    @property
    def _overlaps(self) -> bool:
        """Whether rounds run in the background while the next epoch computes."""
        return self.config.delay_update or self.config.diloco_overlap

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.contribution.buffers

    def backward_weight(self, batch_samples: int) -> float:
        """The trainer's factor for a batch's loss (see :meth:`Contribution.backward_weight`)."""
        return self.contribution.backward_weight(batch_samples)

    # ---- one local step ----------------------------------------------------------------------

    def on_step(self, context: StepContext) -> None:
        """After a backward pass: accumulate, then end the epoch if the swarm is ready."""
        self.contribution.add_batch(context.batch_samples, lambda: self._step_local(context))
        self.samples += context.batch_samples
        self._clock = context.clock
        if self._pending is not None and self._pending.done():
            self.flush()
        if self.replicas is not None and self.replicas.resync_due():
            self._resync()
        if not self._gate.due(self.progress.version, self.samples):
            return  # the tracker hears of these samples with the next estimate
        self.progress.report_local_progress(self.epoch, self.samples)
        swarm = self.progress.current()
        readiness = self._readiness
        if self.state is not None and readiness.behind(swarm, self.epoch):
            self._catch_up(swarm.epoch)
        elif readiness.ready(swarm, self.epoch, self.samples, context.batch_samples):
            pace_s = readiness.pace_s()
            if pace_s > 0:  # keep gathering (min_round_interval_s)
                self._gate.checked(eta_s=pace_s, step_s=local_step_s(swarm, context.batch_samples))
                return
            self.finish_epoch(context)
        elif readiness.alone:  # counted by ready: the estimate is this peer's samples
            missing = swarm.target_batch_size - swarm.samples_accumulated
            self._gate.checked_alone(ready_at_samples=self.samples + missing)
        else:
            step_s = local_step_s(swarm, context.batch_samples)
            self._gate.checked(eta_s=swarm.eta_next_epoch_s, step_s=step_s)

    def _step_local(self, context: StepContext) -> None:
        context.amp.step(self.optimizer)
        context.amp.update()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- average, apply, next epoch ----------------------------------------------------------

    def finish_epoch(self, context: StepContext) -> RoundResult | None:
        """Average with the swarm and apply the result; advances the epoch.

        Returns the round's result, or None when the round goes on in the background.
        """
        try:
            return self._finish_epoch(context)
        finally:
            self._readiness.round_ended()

    def _finish_epoch(self, context: StepContext) -> RoundResult | None:
        self._clock = context.clock
        if self._pending is not None:  # at most one round in flight: apply the previous first
            self.flush()
            self._readiness.count_at(self.progress.current(), self.epoch)  # who is here now
        tensors = self.contribution.prepare(self.samples)
        round_args = dict(
            weight=float(self.samples),
            epoch=self.epoch,
            timeout_s=self.config.averaging_timeout_s,
            expected_peers=self._readiness.num_at_epoch,
        )
        if self._overlaps and not self._readiness.alone:
            self._pending = self.averager.start_average(tensors, **round_args)
            self._pending_epoch = self.epoch
            with self.contribution.replica_in_model():  # what the epoch's listeners read
                # the state of the next epoch is whole once this round lands (``flush``)
                self.epoch_counter.advance_to(self.epoch + 1, state_pending=True)
            return None
        late = self._readiness.joined_late(self.epoch)
        looked = not self._readiness.alone or late
        if not looked:  # nobody else in the swarm: no matchmaking wait for a group of one
            result = alone(self.epoch)
        elif late:  # the others' records have left this epoch, their rounds maybe not yet
            result = self.averager.average(tensors, **round_args)
        else:
            # nobody comes once the swarm has left this epoch: stop looking, catch up at once
            round_args["moved_on"] = moved_on(self.progress, self.epoch)
            result = self.averager.average(tensors, **round_args)
            for _ in range(MAX_EARLY_ROUNDS - 1):
                if not self._early(result):
                    break
                result = self.averager.average(tensors, **round_args)
        self._record(result)
        if looked and self._caught_up_after(result):
            return result
        self.stats.epoch_samples = [*self.stats.epoch_samples[-999:], self.samples]
        with context.clock.phase("optimizer"):
            self.contribution.apply()
        self._next_epoch()
        if result.ok and result.members:
            self._note_round(self.epoch, result.averaged_with, result.num_reached)
        return result

    def _early(self, result: RoundResult) -> bool:
        """Whether a round that found no group was early: this peer has no partners yet (a
        newcomer) and others are still at its epoch (by their records read now, after the
        round). Those others count only their partners' samples toward the target
        (:mod:`peer.swarm.progress`), so they start their round later than a newcomer that
        counts everyone's; stepping alone now would put the newcomer an epoch ahead of them,
        round after round. It looks for their group once more instead (the tensors are
        untouched: a round that found no group averaged nothing). Others that moved on (a
        record that was stale) are caught up with instead (``_caught_up_after``)."""
        if result.status != "alone" or result.members or self.progress.partners:
            return False
        swarm = self._estimate_after_round()
        if swarm.epoch > self.epoch:
            return False
        self._readiness.count_at(swarm, self.epoch)
        return self._readiness.num_at_epoch > 1

    def _caught_up_after(self, result: RoundResult) -> bool:
        """Whether a round that found no group was late instead, and this peer caught up: the
        swarm moved on meanwhile (a record that lagged showed a peer at this epoch that had
        already stepped on alone, so nobody else looked for a group). Stepping alone into the
        swarm's epoch would put this peer there with parameters of its own (in ``grad`` mode,
        apart for good), and just after the lone peer ahead stopped holding for it (its hold
        ran out with this round): then the lone peer steps on alone, its record lags again,
        and the two never meet. The state download (:meth:`Readiness.behind`) puts it where
        the swarm is, the averaged tensors dropped; a download that reached nothing steps alone
        as before."""
        if self.state is None or result.status not in ("alone", "failed"):
            return False  # a failed round, too, averaged nobody's values with this peer's
        swarm = self._estimate_after_round()
        if not self._readiness.behind(swarm, self.epoch):
            return False
        epoch = self.epoch
        self._catch_up(swarm.epoch)
        return self.epoch > epoch

    def _estimate_after_round(self) -> GlobalProgress:
        # A fresh record first: the round reported nothing, and a lone peer ahead holds its
        # boundary only for a peer behind whose record is fresh (peer.swarm.newcomer_hold).
        self.progress.report_local_progress(self.epoch, self.samples)
        return self.progress.current()

    def _next_epoch(self) -> None:
        self.epoch_counter.advance_to(self.epoch + 1)

    def _catch_up(self, swarm_epoch: int) -> None:
        self.flush()
        reached = self.state.catch_up(swarm_epoch, epoch=self.epoch)
        if reached > self.epoch:  # the downloaded state replaces what was accumulated
            self.contribution.discard()
            self.epoch_counter.advance_to(reached)
        else:  # the download announced an arrival that did not happen: the record says so
            self.progress.report_local_progress(self.epoch, self.samples)

    def _resync(self) -> None:
        self.flush()  # a round in flight applies to the replica it was computed on
        reached = self.replicas.resync(self.epoch)
        if reached is not None:
            self.jump_to(reached)

    def jump_to(self, epoch: int) -> None:
        """The model now holds the state of ``epoch`` from outside a round (a download the
        caller made, a state dict it loaded): drop what was gathered and enter that epoch."""
        self.flush()
        self.contribution.discard()
        if not self.epoch_counter.jump_to(epoch):
            self._entered(epoch)  # the same epoch: start gathering it anew all the same

    def _entered(self, epoch: int) -> None:
        """A new epoch, by a round or a download: start gathering anew."""
        self.samples = 0
        self._gate.reset()
        if self.newcomer_hold is not None:
            self.newcomer_hold.reset()
        self._apply_lr()
        self.progress.report_local_progress(epoch, 0)

    def flush(self) -> None:
        """Wait for the round in the background, if any, and apply its result."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        result = pending.wait()
        self._record(result)
        with self._clock.phase("optimizer"):
            self.contribution.apply()
        if result.ok and result.members:  # they entered the next epoch with this peer
            self._note_round(self._pending_epoch + 1, result.averaged_with, result.num_reached)
        with self.contribution.replica_in_model():  # the state of this epoch: served, digested
            self.epoch_counter.settle()

    def _apply_lr(self) -> None:
        if self.lr_schedule is None:
            return
        factor = self.lr_schedule(self.epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def _note_round(self, epoch: int, peer_ids, num_reached: int = 0) -> None:
        self.progress.note_round(epoch, peer_ids, num_reached)
        if self.newcomer_hold is not None:
            self.newcomer_hold.arrived(peer_ids)

    def _record(self, result: RoundResult) -> None:
        self.stats.add(result)
        if not result.ok:
            logger.warning(
                "epoch %d: averaging failed (%s); stepping on local data",
                result.epoch if result.epoch >= 0 else self.epoch,
                result.reason,
            )
