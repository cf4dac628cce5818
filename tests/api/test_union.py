"""Two processes running their own loop on ``peer.Optimizer`` in grad mode end where one process
stepping on the union of their batches ends (as ``peer join`` does in
tests/peer/run/test_join.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # the first optimizer step imports it (seconds): here, not in a timed test

from tests.api.loop import LR, build_model, loss_fn, make_batch
from tests.api.processes import finish, first_line, spawn
from tests.union_reference import round_weights

EPOCHS = 3


def reference_params(seeds: list[int], epoch_samples: list[list[int]], batch: int):
    """One process stepping Adam on the mean gradient of the union of every peer's batches,
    each peer's mean weighted by its samples as the round bounds them (:func:`round_weights`)."""
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    params = list(model.parameters())
    next_index = dict.fromkeys(seeds, 0)
    for epoch in range(len(epoch_samples[0])):
        total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        weights = round_weights([samples[epoch] for samples in epoch_samples])
        for seed, samples, weight in zip(seeds, epoch_samples, weights, strict=True):
            for _ in range(samples[epoch] // batch):
                model.zero_grad()
                loss_fn(model, make_batch(seed, next_index[seed])).backward()
                next_index[seed] += 1
                for accumulator, p in zip(total, params, strict=True):
                    accumulator += p.grad.double() * (batch * weight / samples[epoch])
        for accumulator, p in zip(total, params, strict=True):
            p.grad = (accumulator / sum(weights)).float()
        optimizer.step()
    return [p.detach() for p in params]


def run_two(tmp_path, seeds: list[int], epochs: int, *second_args: str) -> list[dict]:
    outs = [tmp_path / f"peer{seed}.pt" for seed in seeds]
    common = ["-m", "tests.api.loop", "--epochs", str(epochs)]
    first = spawn([*common, "--seed", str(seeds[0]), "--out", str(outs[0])])
    url = first_line(first)
    args = [*common, "--seed", str(seeds[1]), "--out", str(outs[1]), "--initial-peers", url]
    second = spawn([*args, *second_args])
    first_line(second)
    for process in (first, second):
        finish(process, timeout_s=150)
    return [torch.load(out, weights_only=True) for out in outs]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("client_mode", [False, True], ids=["servers", "one-behind-nat"])
def test_two_processes_in_grad_mode_equal_one_process_over_the_union(tmp_path, client_mode):
    """The second peer may run in client mode (no server, as behind a NAT): it still
    contributes its batches and receives the same average."""
    seeds = [11, 22]
    results = run_two(tmp_path, seeds, EPOCHS, *(["--client-mode"] if client_mode else []))
    for result in results:
        assert result["epoch"] == EPOCHS
        assert result["num_failed_rounds"] == 0
        assert result["group_sizes"] == [2] * EPOCHS, result["group_sizes"]
    epoch_samples = [result["epoch_samples"] for result in results]
    for epoch in range(EPOCHS):  # a union: every epoch has batches of both peers
        # (how close each epoch's total comes to the target is the progress estimate's
        # business, tested in tests/peer; the reference uses the samples each peer gave)
        assert all(samples[epoch] > 0 for samples in epoch_samples), epoch_samples
    expected = reference_params(seeds, epoch_samples, batch=16)
    for result in results:
        for got, want in zip(result["params"], expected, strict=True):
            difference = torch.linalg.vector_norm(got.double() - want.double())
            assert difference <= 1e-5 * torch.linalg.vector_norm(want.double())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "target", "extra"),
    [("params", 64, []), ("diloco", 256, []), ("grad", 128, ["--delay"])],
    ids=["params", "diloco", "delayed"],
)
def test_two_processes_in_other_modes_end_equal_with_a_lower_loss(tmp_path, mode, target, extra):
    seeds, epochs = [1, 2], 6
    outs = [tmp_path / f"{mode}{seed}.pt" for seed in seeds]
    common = ["-m", "tests.api.loop", "--epochs", str(epochs), "--mode", mode, *extra]
    common += ["--target-batch-size", str(target)]
    first = spawn([*common, "--seed", "1", "--out", str(outs[0])])
    url = first_line(first)
    second = spawn([*common, "--seed", "2", "--out", str(outs[1]), "--initial-peers", url])
    first_line(second)
    for process in (first, second):
        finish(process, timeout_s=200)
    results = [torch.load(out, weights_only=True) for out in outs]
    for result in results:
        assert result["epoch"] == epochs and result["num_failed_rounds"] == 0
        assert result["group_sizes"][-1] == 2, result["group_sizes"]
        losses = result["losses"]
        first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
        assert last < 0.8 * first, (losses[:8], losses[-8:])
    # the last round leaves both with the average (params) or the same outer step (diloco)
    for got, want in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(got, want)
