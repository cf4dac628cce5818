"""Checkpoints: exact roundtrip, atomic writes, crashes never cost the previous checkpoint."""

from __future__ import annotations

import json
import logging
import os

import pytest
import safetensors
import torch

import peer.train.checkpoint as checkpoint_module
from peer.train.checkpoint import (
    CheckpointDir,
    CheckpointError,
    CheckpointMismatchError,
    Progress,
    load_checkpoint,
    save_checkpoint,
)
from peer.train.tasks.gpt import GPT, GPTConfig

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class WithBuffers(torch.nn.Module):
    """A GPT (tied weights) next to a batch norm (buffers, an int64 counter among them)."""

    def __init__(self, seed: int, width: int = 16):
        super().__init__()
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=width)
        self.gpt = GPT(config)
        self.norm = torch.nn.BatchNorm1d(13)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.gpt(tokens).transpose(1, 2)).transpose(1, 2)


def trained(seed: int = 0, steps: int = 3) -> tuple[WithBuffers, torch.optim.Adam]:
    model = WithBuffers(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for step in range(steps):
        train_step(model, optimizer, step)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 13, (4, 8), generator=generator)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 13), tokens.roll(1, 1).reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, value in state_a.items():
        assert value.dtype == state_b[name].dtype and torch.equal(value, state_b[name]), name


def test_roundtrip_restores_everything_exactly(tmp_path):
    model, optimizer = trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train_step(model, optimizer, 3)
    scheduler.step()
    extra = {
        "scheduler": scheduler.state_dict(),
        "accumulated": [torch.arange(3.0), (1, "two", None)],
        7: True,
    }
    path = tmp_path / "state.safetensors"
    save_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        progress=Progress(epoch=5, step=40, samples=1280),
        extra=extra,
    )

    fresh_model = WithBuffers(seed=1)
    fresh_optimizer = torch.optim.Adam(fresh_model.parameters(), lr=1.0)
    loaded = load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer)

    assert loaded.progress == Progress(epoch=5, step=40, samples=1280)
    assert_same_state(fresh_model, model)
    assert fresh_model.gpt.lm_head.weight is fresh_model.gpt.wte.weight
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    assert restored["param_groups"][0]["betas"] == (0.8, 0.95)
    assert saved["state"].keys() == restored["state"].keys()
    for index, moments in saved["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[key], restored["state"][index][key]), (index, key)
    assert loaded.extra["scheduler"] == scheduler.state_dict()
    assert torch.equal(loaded.extra["accumulated"][0], torch.arange(3.0))
    assert loaded.extra["accumulated"][1] == (1, "two", None) and loaded.extra[7] is True
    # Training on from both gives the same parameters: nothing of the optimizer was lost.
    train_step(model, optimizer, 10)
    train_step(fresh_model, fresh_optimizer, 10)
    assert_same_state(fresh_model, model)


def test_file_is_safetensors_with_json_metadata(tmp_path):
    model, optimizer = trained(steps=1)
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, model=model, optimizer=optimizer, progress=Progress(step=1))
    with safetensors.safe_open(str(path), framework="pt") as file:
        header = json.loads(file.metadata()["volunteer_peer"])
        names = set(file.keys())
    assert header["format"] == "volunteer-peer-checkpoint/1"
    assert header["progress"] == {"epoch": 0, "step": 1, "samples": 0}
    assert "model/gpt.wte.weight" in names and "model/norm.num_batches_tracked" in names


def test_unstorable_extra_state_is_refused(tmp_path):
    model, _ = trained(steps=0)
    with pytest.raises(CheckpointError, match="cannot store a object"):
        save_checkpoint(tmp_path / "x", model=model, progress=Progress(), extra={"a": object()})
    assert list(tmp_path.iterdir()) == []


def test_directory_keeps_the_newest_and_loads_the_latest(tmp_path):
    directory = CheckpointDir(tmp_path / "ckpt", keep=2)
    assert directory.load_latest(model=WithBuffers(0)) is None
    model, optimizer = trained(steps=1)
    for step in range(4):
        train_step(model, optimizer, step)
        directory.save(model=model, optimizer=optimizer, progress=Progress(step=step))
    assert [p.name for p in directory.paths()] == [
        "checkpoint-00000003.safetensors",
        "checkpoint-00000002.safetensors",
    ]
    fresh = WithBuffers(seed=1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    loaded = directory.load_latest(model=fresh, optimizer=fresh_optimizer)
    assert loaded is not None and loaded.progress.step == 3
    assert_same_state(fresh, model)


def test_crash_at_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    directory = CheckpointDir(tmp_path)
    model, optimizer = trained(steps=1)
    directory.save(model=model, optimizer=optimizer, progress=Progress(step=1))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer, 5)

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.os, "replace", crash)
    with pytest.raises(CheckpointError, match="No space left on device"):
        directory.save(model=model, optimizer=optimizer, progress=Progress(step=2))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-00000000.safetensors"]
    fresh = WithBuffers(seed=1)
    loaded = directory.load_latest(model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))
    assert loaded is not None and loaded.progress.step == 1
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_process_killed_mid_write_leaves_a_temp_file_that_never_counts(tmp_path, monkeypatch):
    directory = CheckpointDir(tmp_path)
    model, optimizer = trained(steps=1)
    first = directory.save(model=model, optimizer=optimizer, progress=Progress(step=1))
    # What a SIGKILL during save leaves: a truncated temporary file next to the checkpoint.
    leftover = tmp_path / ".checkpoint-00000001.safetensors.abc123.tmp"
    leftover.write_bytes(first.read_bytes()[:1000])
    assert directory.paths() == [first]
    loaded = directory.load_latest(model=WithBuffers(seed=1))
    assert loaded is not None and loaded.progress.step == 1
    directory.save(model=model, optimizer=optimizer, progress=Progress(step=2))
    assert not leftover.exists()


def test_corrupt_latest_falls_back_to_the_previous(tmp_path, caplog):
    directory = CheckpointDir(tmp_path, keep=3)
    model, optimizer = trained(steps=1)
    directory.save(model=model, optimizer=optimizer, progress=Progress(step=1))
    latest = directory.save(model=model, optimizer=optimizer, progress=Progress(step=2))
    latest.write_bytes(latest.read_bytes()[: os.path.getsize(latest) // 2])
    fresh = WithBuffers(seed=1)
    with caplog.at_level(logging.WARNING, logger="peer.train.checkpoint"):
        loaded = directory.load_latest(model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))
    assert loaded is not None and loaded.progress.step == 1
    assert "skipping unreadable checkpoint" in caplog.text and latest.name in caplog.text
    for path in directory.paths():
        path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints"):
        directory.load_latest(model=fresh)


def test_mismatched_model_or_optimizer_leaves_them_untouched(tmp_path):
    model, optimizer = trained(steps=1)
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, model=model, optimizer=optimizer, progress=Progress())

    wider = torch.nn.Module()
    wider.gpt = GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=32))
    wider.norm = torch.nn.BatchNorm1d(13)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="has shape"):
        load_checkpoint(path, model=wider)
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())

    fresh = WithBuffers(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    params = list(fresh.parameters())
    split = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(CheckpointMismatchError, match="parameter groups"):
        load_checkpoint(path, model=fresh, optimizer=split)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(CheckpointMismatchError, match="missing"):
        load_checkpoint(path, model=torch.nn.Linear(2, 2))


def test_missing_or_foreign_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "absent.safetensors", model=WithBuffers(0))
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        load_checkpoint(foreign, model=WithBuffers(0))
