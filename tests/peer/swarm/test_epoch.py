"""The epoch has one owner: a catch-up (a state download mid-run) moves it for every reader, as a
round does (before, the state server, the round record and the ``max_epochs`` stop kept the old
epoch until the next boundary)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peer.run.runner import PeerRun
from peer.swarm.epoch import Epoch
from peer.swarm.optimizer import CollaborativeConfig, CollaborativeOptimizer
from tests.peer.run.test_join import config
from tests.peer.swarm.test_collaborative import (
    TARGET,
    InstantState,
    NoAveraging,
    OnePeerSwarm,
    step,
)


def test_epoch_moves_forward_only_and_tells_its_listeners():
    epoch, seen = Epoch(2), []
    epoch.subscribe(seen.append)
    assert not epoch.advance_to(2) and not epoch.advance_to(1)
    assert epoch.advance_to(5) and epoch.value == 5 and seen == [5]
    with pytest.raises(ValueError, match="epoch"):
        Epoch(-1)


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
        config=CollaborativeConfig(target_batch_size=TARGET),
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
