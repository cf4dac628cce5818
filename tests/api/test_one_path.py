"""``peer join`` runs on the library's code path: its swarm side is the :class:`Session` that
``peer.Optimizer`` runs, on a ``peer.DHT``; and a ``peer join`` peer and a library peer train
together in one swarm, ending with equal parameters."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

import pytest
import torch

import peer
from peer.api.session import Session
from peer.run.config import PeerConfig
from peer.run.runner import PeerRun
from peer.train.checkpoint import CheckpointDir
from peer.train.tasks import load_task
from tests.api.processes import finish, first_line, spawn
from tests.api.task_loop import LR, RUN_ID, TARGET_BATCH_SIZE, TASK_OPTIONS

EPOCHS = 3


@pytest.mark.timeout(120)
def test_peer_join_swarm_side_is_the_library_session():
    config = PeerConfig(
        task="synthetic",
        task_option=[f"{k}={v}" for k, v in TASK_OPTIONS.items()],
        target_batch_size=TARGET_BATCH_SIZE,
        torch_threads=1,
        publish_interval=0.2,
    )
    run = PeerRun(config)
    try:
        run.start()
        assert isinstance(run.dht, peer.DHT) and isinstance(run.session, Session)
        assert run.trainer.hook is run.session.hook  # the trainer steps the session's optimizer
        assert run.profiler is run.session.profiler  # one clock for the loop and the rounds
        assert run.dht.peer_id == run.peer_id and run.address == run.dht.address
        with urllib.request.urlopen(f"{run.address}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert f'run_id="{config.run_id}"' in text and "vp_epoch 0.0" in text
    finally:
        run.close()
        run.close()  # twice is fine


@pytest.mark.timeout(150)
def test_a_library_newcomer_loads_the_state_a_peer_join_peer_serves():
    """``model=`` gives a library peer the state layout and digest of a ``peer join`` peer of
    the same model: it downloads that peer's state (checked against the digest the peer
    announced) and holds exactly its parameters."""
    config = PeerConfig(
        task="synthetic",
        task_option=[f"{k}={v}" for k, v in TASK_OPTIONS.items()],
        target_batch_size=TARGET_BATCH_SIZE,
        torch_threads=1,
        publish_interval=0.2,
        lr=LR,
    )
    run = PeerRun(config)
    try:
        run.start()
        stop = threading.Event()
        trainer = threading.Thread(
            target=run.trainer.run, kwargs={"stop_event": stop, "on_step": run._on_step}
        )
        trainer.start()
        deadline = time.monotonic() + 60
        while run.epoch < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()  # grad mode: between rounds the parameters are the epoch's served state
        trainer.join(timeout=30)
        assert run.epoch >= 3
        model = load_task("synthetic", TASK_OPTIONS).build_model()
        with peer.DHT(initial_peers=[run.address]) as dht:
            opt = peer.Optimizer(
                dht=dht,
                run_id=config.run_id,
                target_batch_size=TARGET_BATCH_SIZE,
                batch_size_per_step=32,
                optimizer=torch.optim.Adam(model.parameters(), lr=LR),
                model=model,
                publish_interval=0.2,
                summary=False,
            )
            with opt:
                assert opt.local_epoch == run.epoch or opt.load_state_from_peers()
                assert opt.local_epoch == run.epoch and opt.stats.num_rounds == 0
                for name, tensor in run.model.state_dict().items():
                    assert torch.equal(model.state_dict()[name], tensor), name
    finally:
        run.close()


@pytest.mark.timeout(240)
def test_a_peer_join_peer_and_a_library_peer_average_to_equal_parameters(tmp_path):
    """Same seeded model, Adam at the same LR, grad mode: every round of the two gives both the
    same averaged gradient, so after the last round their parameters are equal."""
    out, checkpoints = tmp_path / "library.pt", tmp_path / "ckpt"
    library = spawn(
        ["-m", "tests.api.task_loop", "--seed", "1", "--epochs", str(EPOCHS), "--out", str(out)]
    )
    url = first_line(library)
    options = [arg for k, v in TASK_OPTIONS.items() for arg in ("--task-option", f"{k}={v}")]
    flags = {
        "--run-id": RUN_ID,
        "--initial-peers": url,
        "--target-batch-size": TARGET_BATCH_SIZE,
        "--lr": LR,
        "--optimizer": "adam",
        "--seed": 2,
        "--torch-threads": 1,
        "--matchmaking-time": 10,
        "--averaging-timeout": 20,
        "--publish-interval": 0.2,
        "--wait-for-peers": 2,
        "--max-epochs": EPOCHS,
        "--max-time": 150,
        "--checkpoint-dir": checkpoints,
    }
    arguments = [str(arg) for flag, value in flags.items() for arg in (flag, value)]
    join = spawn(["-m", "peer", "join", "--task", "synthetic", *options, *arguments, "--json"])
    try:
        stdout, stderr = join.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        join.kill()
        library.kill()
        message = f"peer join timed out; stderr:\n{join.communicate()[1][-4000:]}"
        raise AssertionError(message) from None
    assert join.returncode == 0, stderr[-4000:]
    finish(library, timeout_s=60)
    summary = json.loads(stdout.strip().splitlines()[-1])
    mine = torch.load(out, weights_only=True)
    assert summary["epoch"] == mine["epoch"] == EPOCHS
    assert summary["num_failed_rounds"] == mine["num_failed_rounds"] == 0
    assert mine["group_sizes"] == [2] * EPOCHS
    task = load_task("synthetic", TASK_OPTIONS)
    start, theirs = task.build_model(), task.build_model()
    assert CheckpointDir(checkpoints).load_latest(model=theirs).progress.epoch == EPOCHS
    for got, want, initial in zip(
        mine["params"], theirs.parameters(), start.parameters(), strict=True
    ):
        assert not torch.equal(want, initial)  # both trained
        difference = torch.linalg.vector_norm(got.double() - want.detach().double())
        assert difference <= 1e-6 * torch.linalg.vector_norm(want.detach().double())
