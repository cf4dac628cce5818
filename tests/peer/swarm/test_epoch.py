"""The epoch has one owner: a catch-up (a state download mid-run) moves it for every reader, as a
round does (before, the state server, the round record and the ``max_epochs`` stop kept the old
epoch until the next boundary). With rounds in the background, the state of an epoch (what is
served and digested) is the one after the round in flight as it began."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peer.run.runner import PeerRun
from peer.swarm.epoch import Epoch
from peer.swarm.optimizer import CollaborativeOptimizer
from peer.swarm.optimizer_config import CollaborativeConfig
from tests.peer.run.test_join import config
from tests.peer.swarm.test_collaborative import (
    TARGET,
    BackgroundSwarm,
    InstantState,
    NoAveraging,
    OnePeerSwarm,
    TwoPeerSwarm,
    step,
)


# Every target reached closes an epoch (min_round_interval_s=0): these tests script each
# epoch's steps, faster than the pace a swarm's rounds keep by default.
def test_epoch_moves_forward_only_and_tells_its_listeners():
    epoch, seen = Epoch(2), []
    epoch.subscribe(seen.append)
    assert not epoch.advance_to(2) and not epoch.advance_to(1)
    assert epoch.advance_to(5) and epoch.value == 5 and seen == [5]
    with pytest.raises(ValueError, match="epoch"):
        Epoch(-1)


def test_state_listeners_hear_of_an_epoch_once_its_state_is_whole():
    epoch, boundaries, states = Epoch(), [], []
    epoch.subscribe(boundaries.append)
    epoch.subscribe_state(states.append)
    assert epoch.advance_to(1) and boundaries == states == [1]  # no round in flight
    assert epoch.advance_to(2, state_pending=True) and epoch.state_pending
    assert boundaries == [1, 2] and states == [1]  # the round of epoch 1 is still in flight
    assert epoch.settle() and states == [1, 2] and not epoch.state_pending
    assert not epoch.settle() and states == [1, 2]  # once per epoch
    assert epoch.jump_to(7) and states == [1, 2, 7]  # a download: whole at once


def batches(num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(num)]


def test_a_delayed_update_serves_the_next_epoch_once_its_round_landed():
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    swarm_mean = [torch.full_like(p, 0.5) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    epoch, states = Epoch(), []
    epoch.subscribe_state(
        lambda e: states.append((e, [p.detach().clone() for p in model.parameters()]))
    )
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=BackgroundSwarm(swarm_mean, num_steps_late=1),
        progress=TwoPeerSwarm(),
        config=CollaborativeConfig(
            min_round_interval_s=0.0, target_batch_size=TARGET, delay_update=True
        ),
        epoch=epoch,
    )
    start = [p.detach().clone() for p in model.parameters()]
    data = batches(4)
    for inputs, targets in data[:3]:
        step(hook, model, optimizer, inputs, targets)
    assert hook.epoch == 1 and states == []  # epoch 1 began; its state lacks round 0 yet
    step(hook, model, optimizer, *data[3])  # round 0 lands: the state of epoch 1 is whole
    ((served_epoch, served),) = states
    assert served_epoch == 1
    for param, before, mean in zip(served, start, swarm_mean, strict=True):
        torch.testing.assert_close(param, before - 0.1 * mean)


def test_an_overlapped_diloco_peer_serves_the_replica_after_the_round_in_flight():
    torch.manual_seed(2)
    model = nn.Linear(3, 2)
    swarm_mean = [torch.full_like(p, 0.25) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    epoch, states = Epoch(), []
    epoch.subscribe_state(
        lambda e: states.append((e, [p.detach().clone() for p in model.parameters()]))
    )
    config = CollaborativeConfig(
        min_round_interval_s=0.0,
        target_batch_size=TARGET,
        mode="diloco",
        diloco_overlap=True,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=BackgroundSwarm(swarm_mean, num_steps_late=1),
        progress=TwoPeerSwarm(),
        config=config,
        epoch=epoch,
    )
    start = [p.detach().clone().double() for p in model.parameters()]
    data = batches(4)
    for inputs, targets in data[:3]:
        step(hook, model, optimizer, inputs, targets)
    assert hook.epoch == 1 and states == []
    step(hook, model, optimizer, *data[3])
    ((served_epoch, served),) = states
    # the replica after round 0, in float64: Nesterov's first step moves by (1 + mu) * mean
    expected = [
        g - 0.7 * (1 + 0.9) * mean.double() for g, mean in zip(start, swarm_mean, strict=True)
    ]
    assert served_epoch == 1
    for param, reference in zip(served, expected, strict=True):
        torch.testing.assert_close(param.double(), reference, rtol=1e-6, atol=1e-6)
    # the model holds this peer's iterate again: the inner progress of epoch 1 moved onto it
    replica = hook.contribution.outer.replica
    assert all(torch.equal(r, s) for r, s in zip(replica, served, strict=True))
    assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), served, strict=True))


def test_a_catch_up_moves_the_epoch_its_listeners_read():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    epoch, seen = Epoch(), []
    progress = OnePeerSwarm()
    hook = CollaborativeOptimizer(
        model=model,
        optimizer=optimizer,
        averager=NoAveraging(),
        progress=progress,
        config=CollaborativeConfig(min_round_interval_s=0.0, target_batch_size=TARGET),
        epoch=epoch,
        state=InstantState(),
    )
    epoch.subscribe(seen.append)
    for _ in range(2):  # 8 samples: the target, one round
        step(hook, model, optimizer, torch.randn(4, 3), torch.randn(4, 2))
    progress.swarm_epoch = 6  # the swarm is far ahead: the next step downloads its state
    step(hook, model, optimizer, torch.randn(4, 3), torch.randn(4, 2))
    assert seen == [1, 6] and hook.epoch == epoch.value == 6
    assert (progress.epoch, progress.samples) == (6, 0)  # announced at once, nothing carried


@pytest.mark.timeout(90)
def test_a_peer_that_catches_up_serves_records_and_stops_at_the_new_epoch():
    run = PeerRun(config(max_epochs=5))
    try:
        run.start()
        run.hook.state = InstantState()  # a download that lands at the swarm's epoch
        run.hook._catch_up(7)
        assert run.epoch_counter.value == 7 and run.hook.epoch == 7
        run.loop_thread.run(run.services.state_server.settle(), timeout_s=30)
        assert run.services.state_server.served.epoch == 7  # announced, then served
        assert run.reports.round_log.record().epoch == 7
        assert run.stop_event.is_set()  # max_epochs 5 is behind it: the run stops
    finally:
        run.close()
