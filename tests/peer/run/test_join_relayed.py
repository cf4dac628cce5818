"""Two peers reached only through a relay and the reachable peer that relays for them train
together (each peer with its own event-loop thread and server on 127.0.0.1), checked against
one process over the union of their batches."""

from __future__ import annotations

import pytest
import torch

from peer.run.runner import PeerRun
from tests.peer.run.test_join import config, reference_params, train_together

pytestmark = pytest.mark.timeout(180)


def test_two_relayed_peers_and_their_relay_equal_one_process():
    seeds = [5, 6, 7]
    # epochs of the target, unpaced, as in test_join's comparison with one process
    reachable = PeerRun(config(seed=seeds[0], max_epochs=3, min_round_interval=0.0))
    reachable.start()
    runs = [reachable]
    relay = reachable.address
    for seed in seeds[1:]:
        run = PeerRun(
            config(
                seed=seed,
                max_epochs=3,
                min_round_interval=0.0,
                initial_peers=[relay],
                relay_via=[relay],
            )
        )
        run.start()
        runs.append(run)
    assert [run.address for run in runs[1:]] == [
        f"{relay}/v2/relay/{run.services.transport.peer_id}" for run in runs[1:]
    ]
    for run in runs:  # everyone has seen everyone before the first epoch ends
        run.loop_thread.run(run.services.tracker.refresh())
    assert [run.services.averager.client_mode for run in runs] == [False, True, True]
    relay_service = reachable.services.transport.relay
    assert set(relay_service.relayed_peers) == {r.services.transport.peer_id for r in runs[1:]}
    results = train_together(runs)
    assert all(result is not None for result in results)
    for _, epoch, stats in results:
        assert epoch == 3
        assert stats.num_failed_rounds == 0 and stats.num_alone == 0
        assert stats.last_group_size == 3
    epoch_samples = [stats.epoch_samples for _, _, stats in results]
    expected = reference_params(seeds, epoch_samples, lr=1e-3)
    for run in runs:
        for got, want in zip(run.model.parameters(), expected, strict=True):
            difference = torch.linalg.vector_norm(got.detach().double() - want.double())
            assert difference <= 1e-5 * torch.linalg.vector_norm(want.double())
    first = [p.detach() for p in runs[0].model.parameters()]
    for run in runs[1:]:  # the replicas are equal, not only close to the reference
        for got, want in zip(run.model.parameters(), first, strict=True):
            assert torch.equal(got.detach(), want)
