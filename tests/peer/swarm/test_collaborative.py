"""The collaborative optimizer's local logic, with an in-process stand-in for the swarm (the
swarm itself is exercised by the real-peer tests in test_join.py and test_modes.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from averaging.result import RoundResult
from peer.profiling.phases import PhaseClock
from peer.records.progress import PeerProgress
from peer.swarm.optimizer import CollaborativeOptimizer
from peer.swarm.optimizer_config import CollaborativeConfig
from peer.swarm.progress import GlobalProgress
from peer.train.schedules import make_lr_schedule
from peer.train.trainer import StepContext

# Every target reached closes an epoch (min_round_interval_s=0): these tests script each
# epoch's steps, faster than the pace a swarm's rounds keep by default.

TARGET = 8


class OnePeerSwarm:
    """Progress of a swarm with this peer alone (or led by ``swarm_epoch``)."""

    def __init__(self) -> None:
        self.epoch = self.samples = 0
        self.swarm_epoch = 0

    def report_local_progress(self, epoch: int, samples: int) -> None:
        self.epoch, self.samples = epoch, samples

    @property
    def version(self) -> int:
        return self.swarm_epoch  # what the estimate extrapolates from: the others' epoch

    def current(self) -> GlobalProgress:
        rate = 1e6  # samples/s: the real steps here take microseconds
        own = PeerProgress("me", self.epoch, self.samples, rate, 0.0, None, False)
        epoch = max(self.epoch, self.swarm_epoch)
        return GlobalProgress(
            epoch=epoch,
            samples_accumulated=self.samples if epoch == self.epoch else 0,
            target_batch_size=TARGET,
            samples_per_s=rate,
            eta_next_epoch_s=max(0, TARGET - self.samples) / rate,
            num_peers=1,
            num_clients=0,
            peers=(own,),
        )

    partners = frozenset()

    def note_round(self, epoch, peer_ids, num_reached=0) -> None:
        pass


class NoAveraging:
    def average(self, tensors, **kwargs) -> RoundResult:
        return RoundResult("alone")


class InstantState:
    """A state download that always reaches the swarm's epoch."""

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        return swarm_epoch


def make(model, *, in_grad=True, lr_schedule=None, state=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=NoAveraging(),
        progress=OnePeerSwarm(),
        config=CollaborativeConfig(
            min_round_interval_s=0.0, target_batch_size=TARGET, accumulate_in_grad=in_grad
        ),
        lr_schedule=lr_schedule,
        state=state,
    )
    return hook, optimizer


def step(hook, model, optimizer, inputs, targets):
    """What the trainer does for one local step."""
    loss = nn.functional.mse_loss(model(inputs), targets)
    (loss * hook.backward_weight(len(targets))).backward()
    context = StepContext(0, len(targets), loss.detach(), model, optimizer, _NoAmp(), PhaseClock())
    hook.on_step(context)


class _NoAmp:
    def step(self, optimizer):
        optimizer.step()

    def update(self):
        pass


@pytest.mark.parametrize("in_grad", [True, False])
def test_one_epoch_steps_on_the_mean_gradient_of_all_its_samples(in_grad):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    reference = nn.Linear(3, 2).double()
    reference.load_state_dict(model.state_dict())
    hook, optimizer = make(model, in_grad=in_grad)
    sizes = [3, 1, 4]  # uneven batches: weights by samples matter
    batches = [(torch.randn(n, 3), torch.randn(n, 2)) for n in sizes]
    for inputs, targets in batches:
        step(hook, model, optimizer, inputs, targets)
    assert hook.epoch == 1
    # reference: one SGD step on the mean loss over the union of the 8 samples, in float64
    inputs = torch.cat([b[0] for b in batches]).double()
    targets = torch.cat([b[1] for b in batches]).double()
    nn.functional.mse_loss(reference(inputs), targets).backward()
    with torch.no_grad():
        for param in reference.parameters():
            param -= 0.1 * param.grad
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-7)


def test_lr_follows_the_swarm_epoch_also_across_a_catch_up():
    schedule = make_lr_schedule("cosine", warmup_epochs=1, total_epochs=5, min_lr_ratio=0.1)
    assert schedule(0) == pytest.approx(0.5)
    assert schedule(1) == pytest.approx(1.0)
    assert schedule(3) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(5) == pytest.approx(0.1) and schedule(50) == pytest.approx(0.1)
    model = nn.Linear(3, 2)
    hook, optimizer = make(model, lr_schedule=schedule, state=InstantState())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * schedule(0))
    for _ in range(2):
        step(hook, model, optimizer, torch.randn(4, 3), torch.randn(4, 2))
    assert hook.epoch == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * schedule(1))
    hook.progress.swarm_epoch = 4  # the swarm is ahead: catch up (a state download)
    step(hook, model, optimizer, torch.randn(4, 3), torch.randn(4, 2))
    assert hook.epoch == 4
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * schedule(4))


class BackgroundSwarm:
    """A round that ends after ``num_steps_late`` more local steps, replacing the peer's mean
    gradient with ``swarm_mean`` (what the other peers' contributions made of it)."""

    def __init__(self, swarm_mean: list[torch.Tensor], num_steps_late: int):
        self.swarm_mean, self.num_steps_late = swarm_mean, num_steps_late
        self.started: list[list[torch.Tensor]] = []
        self.pending = None

    def average(self, tensors, **kwargs) -> RoundResult:
        raise AssertionError("a delayed update must not block")

    def start_average(self, tensors, *, weight, epoch, timeout_s, expected_peers):
        self.started.append([t.clone() for t in tensors])
        averager = self

        class Pending:
            steps_left = averager.num_steps_late

            def done(self) -> bool:
                self.steps_left -= 1
                return self.steps_left < 0

            def wait(self) -> RoundResult:
                for tensor, mean in zip(tensors, averager.swarm_mean, strict=True):
                    tensor.copy_(mean)
                return RoundResult("ok", members=("me", "other"))

        self.pending = Pending()
        return self.pending


class TwoPeerSwarm(OnePeerSwarm):
    def current(self) -> GlobalProgress:
        progress = super().current()
        other = PeerProgress("other", self.epoch, 0, 100.0, 0.0, None, False)
        return dataclasses.replace(progress, peers=(*progress.peers, other), num_peers=2)


def test_delayed_update_applies_the_swarm_average_one_epoch_late_without_blocking():
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    swarm_mean = [torch.full_like(p, 0.5) for p in model.parameters()]
    averager = BackgroundSwarm(swarm_mean, num_steps_late=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=averager,
        progress=TwoPeerSwarm(),
        config=CollaborativeConfig(
            min_round_interval_s=0.0, target_batch_size=TARGET, delay_update=True
        ),
    )
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
    start = [p.detach().clone() for p in model.parameters()]
    for inputs, targets in batches[:2]:
        step(hook, model, optimizer, inputs, targets)
    # epoch 0 is over; its round runs in the background and nothing has moved yet
    assert hook.epoch == 1 and len(averager.started) == 1
    for param, before in zip(model.parameters(), start, strict=True):
        assert torch.equal(param, before)
    # what was sent is this peer's mean gradient over epoch 0, computed independently
    reference = nn.Linear(3, 2)
    reference.load_state_dict(dict(zip(["weight", "bias"], start, strict=True)))
    inputs = torch.cat([b[0] for b in batches[:2]])
    targets = torch.cat([b[1] for b in batches[:2]])
    nn.functional.mse_loss(reference(inputs), targets).backward()
    for sent, param in zip(averager.started[0], reference.parameters(), strict=True):
        torch.testing.assert_close(sent, param.grad)
    # one step into epoch 1 the round is still running; at the next it ends and is applied
    step(hook, model, optimizer, *batches[2])
    for param, before in zip(model.parameters(), start, strict=True):
        assert torch.equal(param, before)
    step(hook, model, optimizer, *batches[3])
    for param, before, mean in zip(model.parameters(), start, swarm_mean, strict=True):
        torch.testing.assert_close(param.detach(), before - 0.1 * mean)
    assert hook.stats.num_rounds == 1 and hook.stats.last_group_size == 2
    # epoch 1's gradient (batches 2 and 3, at the old and new parameters) went on accumulating
    assert hook.epoch == 2 and len(averager.started) == 2


class LaggingRecordSwarm(OnePeerSwarm):
    """A newcomer's view of a swarm of one other peer, ``first``, at ``first_epoch`` with the
    target reached; the newcomer has no partners yet, so it counts ``first``'s samples."""

    def __init__(self) -> None:
        super().__init__()
        self.first_epoch = 0
        self.reports: list[tuple[int, int]] = []

    def report_local_progress(self, epoch: int, samples: int) -> None:
        super().report_local_progress(epoch, samples)
        self.reports.append((epoch, samples))

    @property
    def version(self) -> int:
        return self.first_epoch

    def current(self) -> GlobalProgress:
        rate = 1e6
        own = PeerProgress("me", self.epoch, self.samples, rate, 0.0, None, False)
        first = PeerProgress("first", self.first_epoch, TARGET, rate, 0.0, None, False)
        epoch = max(self.epoch, self.first_epoch)  # a majority of the others: the one other
        accumulated = (self.samples if self.epoch == epoch else 0) + (
            TARGET if self.first_epoch == epoch else 0
        )
        return GlobalProgress(
            epoch=epoch,
            samples_accumulated=accumulated,
            target_batch_size=TARGET,
            samples_per_s=2 * rate,
            eta_next_epoch_s=0.0,
            num_peers=2,
            num_clients=0,
            peers=(own, first),
        )


class MovedOnDuringTheRound:
    """The newcomer's round at the epoch a lagging record showed ``first`` at: ``first`` had
    already stepped on alone, so nobody else looks for a group; by the round's end the records
    show it one epoch ahead."""

    def __init__(self, swarm: LaggingRecordSwarm):
        self.swarm = swarm
        self.num_rounds = 0

    def average(self, tensors, **kwargs) -> RoundResult:
        self.num_rounds += 1
        self.swarm.first_epoch = kwargs["epoch"] + 1
        self.swarm.reports.append(("round", kwargs["epoch"]))
        return RoundResult("alone", "no other peer was looking for a group")


class FirstPeersState:
    """``first``'s state of the swarm's epoch, downloaded into the newcomer's model."""

    def __init__(self, model: nn.Module, swarm: LaggingRecordSwarm):
        self.model, self.swarm = model, swarm
        self.donor = [torch.full_like(p, 0.25) for p in model.parameters()]
        self.calls: list[tuple[int, int]] = []
        self.reports_before: list = []

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        self.calls.append((swarm_epoch, epoch))
        self.reports_before = list(self.swarm.reports)
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), self.donor, strict=True):
                param.copy_(value)
        return swarm_epoch


def test_a_newcomer_whose_round_found_nobody_because_the_swarm_moved_on_downloads_its_state():
    """Issue 24: a newcomer took a lagging record for a peer at its epoch and waited out a
    round alone; the other peer had stepped on meanwhile. Stepping alone into the epoch the
    swarm is at left it with parameters of its own, a round behind a lone peer that stopped
    holding for it, round after round; it downloads the swarm's state instead, and says first
    (a fresh record) that it is catching up, so that a lone peer ahead holds for it."""
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    swarm = LaggingRecordSwarm()
    averager = MovedOnDuringTheRound(swarm)
    state = FirstPeersState(model, swarm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=averager,
        progress=swarm,
        config=CollaborativeConfig(min_round_interval_s=0.0, target_batch_size=TARGET),
        state=state,
    )
    step(hook, model, optimizer, torch.randn(4, 3), torch.randn(4, 2))
    assert averager.num_rounds == 1  # others were no longer at its epoch: no second look
    assert state.calls == [(1, 0)]
    # a report dated after the round, before the download: the lone peer ahead holds for it
    round_index = state.reports_before.index(("round", 0))
    assert (0, 4) in state.reports_before[round_index + 1 :]
    assert hook.epoch == 1
    assert hook.stats.num_alone == 1
    # it holds the swarm's state, with no step of its own on top
    for param, donor in zip(model.parameters(), state.donor, strict=True):
        torch.testing.assert_close(param.detach(), donor, rtol=0, atol=0)
