"""Peers training together for real (threads of one process, each peer with its own event-loop
thread and HTTP server on 127.0.0.1), checked against a single process."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch._dynamo  # the first optimizer step imports it (seconds): here, not in a timed test

from peer.run.config import PeerConfig
from peer.run.runner import PeerRun
from peer.swarm.state_sync import StateSnapshot
from peer.train.tasks import DataShard, load_task
from tests.union_reference import round_weights

pytestmark = pytest.mark.timeout(180)
TASK_OPTIONS = ["hidden_dim=64", "num_eval_batches=0"]


def config(**changes) -> PeerConfig:
    base = dict(
        task="synthetic",
        task_option=TASK_OPTIONS,
        target_batch_size=256,
        mode="grad",
        matchmaking_time=10.0,
        averaging_timeout=20.0,
        torch_threads=1,
        publish_interval=0.2,
    )
    return PeerConfig(**{**base, **changes})


def start_swarm(configs: list[PeerConfig]) -> list[PeerRun]:
    """Start the peers one after another, each bootstrapping from the first."""
    runs: list[PeerRun] = []
    for peer_config in configs:
        initial = [runs[0].address] if runs else []
        run = PeerRun(peer_config.model_copy(update={"initial_peers": initial}))
        run.start()
        runs.append(run)
    for run in runs:  # everyone has seen everyone before the first epoch ends
        run.loop_thread.run(run.services.tracker.refresh())
    return runs


def train_together(runs: list[PeerRun]) -> list:
    """Each peer's training loop in a thread of its own, as each would run in its process."""
    results: list = [None] * len(runs)

    def train(index: int) -> None:
        run = runs[index]
        try:
            result = run.trainer.run(stop_event=run.stop_event, on_step=run._on_step)
            results[index] = (result, run.hook.epoch, run.hook.stats)
        finally:
            run.close()

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    return results


def reference_params(seeds: list[int], epoch_samples: list[list[int]], lr: float):
    """One process stepping Adam on the mean gradient of the union of every peer's batches,
    each peer's mean weighted by its samples as the round bounds them (:func:`round_weights`)."""
    task = load_task("synthetic", dict(option.split("=") for option in TASK_OPTIONS))
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    streams = [iter(task.make_loader(DataShard(seed=seed))) for seed in seeds]
    params = list(model.parameters())
    for epoch in range(len(epoch_samples[0])):
        total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        weights = round_weights([samples[epoch] for samples in epoch_samples])
        for stream, samples, weight in zip(streams, epoch_samples, weights, strict=True):
            for _ in range(samples[epoch] // task.batch_size):
                inputs, targets = next(stream)
                model.zero_grad()
                task.loss_fn(model(inputs), targets).backward()
                for accumulator, p in zip(total, params, strict=True):
                    accumulator += p.grad.double() * (len(targets) * weight / samples[epoch])
        for accumulator, p in zip(total, params, strict=True):
            p.grad = (accumulator / sum(weights)).float()
        optimizer.step()
    return [p.detach() for p in params]


def test_two_peers_in_grad_mode_equal_one_process_over_the_union_of_their_batches():
    seeds = [11, 22]
    # epochs of the target, unpaced: the float32 sums of a paced epoch's many more batches
    # stray further from the float64 reference than the bound below
    runs = start_swarm([config(seed=seed, max_epochs=3, min_round_interval=0.0) for seed in seeds])
    results = train_together(runs)
    assert all(result is not None for result in results)
    for _, epoch, stats in results:
        assert epoch == 3
        assert stats.num_failed_rounds == 0 and stats.num_alone == 0
        assert stats.last_group_size == 2
    epoch_samples = [stats.epoch_samples for _, _, stats in results]
    # Each peer's estimate extrapolates its partner's last record by its rate, so a partner
    # that stalls (a loaded host) can make a round start before the real total reaches the
    # target: 224 of 256 in one CI run, at epochs of a few milliseconds. The reference weighs
    # what each round really counted; the estimate's error has tests of its own.
    for epoch in range(3):
        assert sum(samples[epoch] for samples in epoch_samples) >= 32
    expected = reference_params(seeds, epoch_samples, lr=1e-3)
    # relative difference ||got - want|| / ||want|| per tensor: Adam divides each gradient by
    # its own magnitude, so an element whose per-sample gradients cancel out (float32 sums keep
    # little of it) can differ far more than the tensor as a whole
    for run in runs:
        for got, want in zip(run.model.parameters(), expected, strict=True):
            difference = torch.linalg.vector_norm(got.detach().double() - want.double())
            assert difference <= 1e-5 * torch.linalg.vector_norm(want.double())


def train_in_thread(run: PeerRun) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: run.trainer.run(stop_event=run.stop_event, on_step=run._on_step)
    )
    thread.start()
    return thread


def stop(run: PeerRun, thread: threading.Thread | None) -> None:
    run.stop_event.set()
    if thread is not None:
        thread.join(timeout=60)
    run.close()


def wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_newcomer_downloads_the_state_and_joins_the_next_round(tmp_path):
    # epochs of a second or more here, so that the newcomer can catch one
    slow = {"target_batch_size": 8192, "publish_interval": 0.1}
    metrics_path = tmp_path / "newcomer.jsonl"
    (first,) = start_swarm([config(seed=1, **slow)])
    first_thread = train_in_thread(first)
    newcomer, newcomer_thread = None, None
    try:
        wait_for(
            lambda: (first.services.state_server.served or StateSnapshot(0, {})).epoch >= 2,
            "the first peer did not announce (and serve) the state of epoch 2",
        )
        newcomer = PeerRun(
            config(seed=2, initial_peers=[first.address], metrics_file=metrics_path, **slow)
        )
        newcomer.start()
        epoch = newcomer.hook.epoch
        assert epoch >= 2
        # its metrics stream has the download: every second the clock charged to it, and the
        # state's bytes (a stream opened after the download lost both; the verdict named the
        # all-reduce of the few seconds after it)
        newcomer.metrics.report(epoch=epoch, step=0, loss=None)
        (line,) = [json.loads(text) for text in metrics_path.read_text().splitlines()]
        downloaded_s = newcomer.profiler.clock.snapshot().seconds["state_sync"]
        assert downloaded_s > 0 and line["phases"]["state_sync"] == pytest.approx(downloaded_s)
        state_bytes = sum(p.numel() * p.element_size() for p in newcomer.model.parameters())
        assert line["net"]["recv"] >= state_bytes
        # what it loaded is the first peer's state of that epoch, bit for bit: the same digest
        # (the first peer may have moved on meanwhile; it keeps its last epochs' digests)
        digests = newcomer.services.state_server.digests
        wait_for(lambda: any(d.epoch == epoch for d in list(digests)), "no digest of the newcomer")
        ours = {d.epoch: d.digest for d in list(digests)}
        theirs = {d.epoch: d.digest for d in list(first.services.state_server.digests)}
        assert ours[epoch] == theirs[epoch]
        newcomer_thread = train_in_thread(newcomer)
        wait_for(
            lambda: newcomer.hook.stats.last_group_size == 2,
            "the newcomer never averaged with the first",
        )
    finally:
        if newcomer is not None:
            stop(newcomer, newcomer_thread)
        stop(first, first_thread)


def test_a_newcomer_catches_a_lone_peer_whose_epochs_are_faster_than_a_download():
    """Epochs of ~20 ms alone: without the lone peer holding its boundary for the newcomer, the
    newcomer's state is stale on arrival, it downloads again, and never averages."""
    # a newcomer that takes a stale record for a partner waits out matchmaking alone first
    quick = {"matchmaking_time": 2.0}
    (first,) = start_swarm([config(seed=1, **quick)])
    first_thread = train_in_thread(first)
    newcomer, newcomer_thread = None, None
    try:
        wait_for(
            lambda: first.services.tracker.global_progress.epoch >= 20,
            "the first peer did not publish epoch 20",
        )
        newcomer = PeerRun(config(seed=2, initial_peers=[first.address], **quick))
        newcomer.start()
        newcomer_thread = train_in_thread(newcomer)
        wait_for(
            lambda: newcomer.hook.stats.last_group_size == 2,
            "the newcomer never averaged with the first",
            timeout_s=30,
        )
        assert first.hook.newcomer_hold.num_holds >= 1
        # from then on they step together on the same averages: same epoch, same parameters
        last_epoch = newcomer.hook.epoch + 5
        for run in (first, newcomer):
            run.config = run.config.model_copy(update={"max_epochs": last_epoch})
        for thread in (first_thread, newcomer_thread):
            thread.join(timeout=60)
        assert first.hook.epoch == newcomer.hook.epoch == last_epoch
        assert newcomer.hook.stats.last_group_size == 2
        assert newcomer.hook.stats.num_failed_rounds == 0
        for ours, theirs in zip(first.model.parameters(), newcomer.model.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    finally:
        if newcomer is not None:
            stop(newcomer, newcomer_thread)
        stop(first, first_thread)


def test_fast_epochs_hold_the_target_batch_size_on_average():
    """Epochs of a few tens of milliseconds (far shorter than the publishing interval): the
    swarm's estimate must neither end epochs early nor let them run long."""
    target = 1024
    # the estimate alone decides when an epoch ends (min_round_interval 0): epochs here are
    # shorter than its 0.05 s
    # both stop at the same boundary (a timer could stop one mid-round and leave the other to
    # end an epoch alone)
    configs = [
        config(seed=seed, target_batch_size=target, max_epochs=40, min_round_interval=0.0)
        for seed in (1, 2)
    ]
    results = train_together(start_swarm(configs))
    assert all(result is not None for result in results)
    (_, epoch_a, stats_a), (_, epoch_b, stats_b) = results
    assert epoch_a == epoch_b >= 10
    assert stats_a.num_failed_rounds == stats_b.num_failed_rounds == 0
    # both peers took part in every round: per-epoch samples line up; skip the start-up epochs
    swarm_samples = [
        a + b for a, b in zip(stats_a.epoch_samples, stats_b.epoch_samples, strict=True)
    ][2:]
    mean = sum(swarm_samples) / len(swarm_samples)
    assert 0.9 * target <= mean <= 1.3 * target, swarm_samples
