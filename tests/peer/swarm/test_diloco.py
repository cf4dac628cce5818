"""DiLoCo's outer step through the collaborative optimizer, blocking and overlapped, against a
float64 reference of the update in :mod:`peer.swarm.diloco` (hand-computable values: a quadratic
whose inner SGD step is ``w <- w - ρ (w - t)``, and a second peer whose pseudo-gradient is a
constant), with an in-process stand-in for the round (the real swarm: test_diloco_peers.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from averaging.result import RoundResult
from dht.errors import ConfigError
from peer.profiling.phases import PhaseClock
from peer.swarm.optimizer import CollaborativeOptimizer
from peer.swarm.optimizer_config import CollaborativeConfig
from peer.train.trainer import StepContext
from tests.peer.swarm.test_collaborative import TwoPeerSwarm, _NoAmp

# Every target reached closes an epoch (min_round_interval_s=0): these tests script each
# epoch's steps, faster than the pace a swarm's rounds keep by default.

TARGET = 8  # as TwoPeerSwarm's
BATCH = 2  # four inner steps per epoch
INNER_LR = 0.25
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
START = (1.0, -2.0)
GOAL = (3.0, -1.0)
OTHER = (0.3, -0.1)  # the other peer's pseudo-gradient, every round (as many samples as ours)


class Quadratic(nn.Module):
    """``0.5 ||w - GOAL||^2``: its gradient is ``w - GOAL``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(START))

    def forward(self) -> torch.Tensor:
        return 0.5 * ((self.w - torch.tensor(GOAL)) ** 2).sum()


class OtherPeer:
    """A group of this peer and one other of equal weight: the average is (own + OTHER) / 2.
    In the background, a round ends at the ``num_steps_late + 1``-th local step after it began
    (or when the boundary after it waits for it)."""

    def __init__(self, num_steps_late: int = 0):
        self.num_steps_late = num_steps_late
        self.sent: list[torch.Tensor] = []

    def _mix(self, tensors) -> RoundResult:
        (tensor,) = tensors
        tensor.add_(torch.tensor(OTHER)).div_(2)
        return RoundResult("ok", members=("me", "other"))

    def average(self, tensors, **kwargs) -> RoundResult:
        self.sent.append(tensors[0].clone())
        return self._mix(tensors)

    def start_average(self, tensors, *, weight, epoch, timeout_s, expected_peers):
        self.sent.append(tensors[0].clone())
        owner = self

        class Pending:
            steps_left = owner.num_steps_late

            def done(self) -> bool:
                self.steps_left -= 1
                return self.steps_left < 0

            def wait(self) -> RoundResult:
                return owner._mix(tensors)

        return Pending()


def make(overlap: bool, averager: OtherPeer):
    model = Quadratic()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    config = CollaborativeConfig(
        min_round_interval_s=0.0,
        mode="diloco",
        target_batch_size=TARGET,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        diloco_overlap=overlap,
    )
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=averager,
        progress=TwoPeerSwarm(),
        config=config,
    )
    return hook, model, optimizer


def step(hook, model, optimizer) -> None:
    """What the trainer does for one local step."""
    loss = model()
    loss.backward()
    context = StepContext(0, BATCH, loss.detach(), model, optimizer, _NoAmp(), PhaseClock())
    hook.on_step(context)


class Reference:
    """The update of :mod:`peer.swarm.diloco` in float64, one local step at a time."""

    def __init__(self, overlap: bool, num_steps_late: int = 0):
        self.overlap, self.num_steps_late = overlap, num_steps_late
        self.x = torch.tensor(START, dtype=torch.float64)
        self.g, self.a = self.x.clone(), self.x.clone()
        self.m = torch.zeros(2, dtype=torch.float64)
        self.pending: torch.Tensor | None = None  # Δ of the round in flight
        self.steps_since = 0
        self.samples = 0
        self.sent: list[torch.Tensor] = []
        self.replicas_at_boundary: list[torch.Tensor] = []

    def outer(self, delta: torch.Tensor) -> None:
        average = (delta + torch.tensor(OTHER, dtype=torch.float64)) / 2
        self.m = OUTER_MOMENTUM * self.m + average
        self.g = self.g - OUTER_LR * (average + OUTER_MOMENTUM * self.m)
        self.x = self.g + (self.x - self.a)  # the progress since the boundary, kept
        self.a = self.g.clone()

    def step(self) -> None:
        self.x = self.x - INNER_LR * (self.x - torch.tensor(GOAL, dtype=torch.float64))
        self.samples += BATCH
        if self.pending is not None:
            self.steps_since += 1
            if self.steps_since > self.num_steps_late:
                self.flush()
        if self.samples >= TARGET:
            self.boundary()

    def boundary(self) -> None:
        self.flush()
        delta = self.a - self.x
        self.sent.append(delta)
        self.samples = 0
        self.a = self.x.clone()  # the next phase's progress counts from here
        if self.overlap:  # the round goes on in the background meanwhile
            self.pending, self.steps_since = delta, 0
        else:
            self.outer(delta)
        self.replicas_at_boundary.append(self.g.clone())

    def flush(self) -> None:
        if self.pending is not None:
            delta, self.pending = self.pending, None
            self.outer(delta)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.detach().double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("overlap", "num_steps_late"),
    [(False, 0), (True, 1), (True, 100)],
    ids=["blocking", "lands-mid-epoch", "lands-at-next-boundary"],
)
def test_outer_update_equals_the_float64_reference(overlap, num_steps_late):
    averager = OtherPeer(num_steps_late)
    hook, model, optimizer = make(overlap, averager)
    seen_at_epoch_change: list[torch.Tensor] = []
    hook.epoch_counter.subscribe(lambda _: seen_at_epoch_change.append(model.w.detach().clone()))
    reference = Reference(overlap, num_steps_late)
    for _ in range(5 * TARGET // BATCH):  # five epochs
        step(hook, model, optimizer)
        reference.step()
        close(model.w, reference.x)
    assert hook.epoch == 5 and hook.stats.num_rounds == (5 if not overlap else 4)
    for sent, want in zip(averager.sent, reference.sent, strict=True):
        close(sent, want)
    # what an epoch change shows its listeners (the state served, its digest, checkpoints) is
    # the replica g, never the peer's own iterate
    for shown, want in zip(seen_at_epoch_change, reference.replicas_at_boundary, strict=True):
        close(shown, want)
    # stopped at a boundary, the round in flight lands: the model is g, bit for bit
    hook.flush()
    reference.flush()
    close(model.w, reference.g)
    assert torch.equal(model.w.detach(), hook.contribution.outer.replica[0])


def test_overlapped_rounds_never_block_the_inner_steps():
    averager = OtherPeer(num_steps_late=2)
    hook, model, optimizer = make(True, averager)
    for _ in range(TARGET // BATCH):
        step(hook, model, optimizer)
    assert hook.epoch == 1 and len(averager.sent) == 1
    before = model.w.detach().clone()
    step(hook, model, optimizer)  # the round is still running: a plain inner step
    close(model.w, before.double() - INNER_LR * (before.double() - torch.tensor(GOAL).double()))


def test_hand_computed_first_overlapped_round():
    """One round by hand: w0 = (1, -2), GOAL = (3, -1), inner SGD 0.25 (w <- 0.75 w + 0.25 GOAL)."""
    averager = OtherPeer(num_steps_late=0)  # lands at the first step after the boundary
    hook, model, optimizer = make(True, averager)
    for _ in range(TARGET // BATCH + 1):
        step(hook, model, optimizer)
    # after 4 inner steps: w - GOAL = 0.75**4 (w0 - GOAL) = 0.31640625 * (-2, -1)
    x4 = torch.tensor([3 - 0.6328125, -1 - 0.31640625], dtype=torch.float64)
    delta = torch.tensor(START, dtype=torch.float64) - x4  # (-1.3671875, -0.68359375)
    x5 = x4 - INNER_LR * (x4 - torch.tensor(GOAL, dtype=torch.float64))
    average = (delta + torch.tensor(OTHER, dtype=torch.float64)) / 2
    g1 = torch.tensor(START, dtype=torch.float64) - OUTER_LR * (1 + OUTER_MOMENTUM) * average
    close(model.w, g1 + (x5 - x4))


def test_diloco_overlap_needs_mode_diloco():
    with pytest.raises(ConfigError, match="diloco_overlap needs mode diloco"):
        CollaborativeConfig(min_round_interval_s=0.0, target_batch_size=8, diloco_overlap=True)


class OneAheadSwarm(TwoPeerSwarm):
    """The other peer's record is one epoch ahead: it entered that epoch as its round of this
    one began in the background, and may still be looking for a group."""

    def current(self):
        progress = super().current()
        own, other = progress.peers
        ahead = dataclasses.replace(other, epoch=self.epoch + 1)
        return dataclasses.replace(progress, epoch=self.epoch + 1, peers=(own, ahead))


class Downloads:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def catch_up(self, swarm_epoch: int, *, epoch: int) -> int:
        self.calls.append((swarm_epoch, epoch))
        return epoch  # reached nothing: the test looks only at whether it was asked


class Nobody(OtherPeer):
    def average(self, tensors, **kwargs) -> RoundResult:
        self.sent.append(tensors[0].clone())
        return RoundResult("alone", "no other peer was looking for a group")


@pytest.mark.parametrize("found", [True, False], ids=["joins-their-round", "then-downloads"])
def test_one_epoch_behind_an_overlapped_swarm_joins_its_round_before_downloading(found):
    averager = OtherPeer() if found else Nobody()
    hook, model, optimizer = make(True, averager)
    hook.progress = OneAheadSwarm()
    hook.state = downloads = Downloads()
    step(hook, model, optimizer)
    assert len(averager.sent) == 1  # it looked for the group of its epoch, blocking
    assert downloads.calls == ([] if found else [(1, 0)])
    if found:  # and stepped with it: the model is the replica
        assert hook.epoch == 1 and hook._pending is None
        assert torch.equal(model.w.detach(), hook.contribution.outer.replica[0])
