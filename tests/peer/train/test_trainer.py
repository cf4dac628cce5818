"""The local loop: exactly a hand-written PyTorch loop, stop conditions, phases, hooks, device."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch
from torch.utils.data import IterableDataset

from peer.bench.baseline import BaselineRun, run_baseline
from peer.profiling.phases import PhaseClock
from peer.train.device import Amp, select_device, to_device, use_pinned_memory
from peer.train.tasks import DataShard, Task, load_task
from peer.train.trainer import StepContext, StepReport, Trainer, TrainerConfig, evaluate

pytestmark = pytest.mark.timeout(60)
SMALL = {"hidden_dim": 32, "input_dim": 64, "batch_size": 16}


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Where the trainer trains by default (a CUDA machine: the GPU); the references run there too,
# in float32 (the trainers they are held against turn mixed precision off)
DEVICE = select_device("auto")
FLOAT32 = TrainerConfig(amp="off")


def hand_loop(task: Task, shard: DataShard, num_steps: int, max_grad_norm=None):
    """The reference: the loop a PyTorch user writes, over the same batches."""
    model = task.build_model().to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in itertools.islice(task.make_loader(shard), num_steps):
        inputs, targets = inputs.to(DEVICE), targets.to(DEVICE)
        optimizer.zero_grad()
        loss = task.loss_fn(model(inputs), targets)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def make_trainer(task: Task, shard: DataShard, **config) -> Trainer:
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return Trainer(
        task, model, optimizer, shard=shard, config=TrainerConfig(**{"amp": "off", **config})
    )


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_trainer_equals_a_hand_written_loop(max_grad_norm):
    task = load_task("synthetic", SMALL)
    shard = DataShard(index=1, count=3, seed=4)
    reference, losses = hand_loop(task, shard, 25, max_grad_norm)
    reports: list[StepReport] = []
    with make_trainer(task, shard, max_grad_norm=max_grad_norm) as trainer:
        result = trainer.run(max_steps=25, on_step=reports.append)
    assert result.stopped_by == "max_steps" and result.num_steps == 25 == trainer.step
    assert result.num_samples == 25 * 16 == reports[-1].total_samples
    assert [r.loss for r in reports] == losses
    assert result.last_loss == losses[-1]
    assert_same_parameters(trainer.model, reference)


@pytest.mark.timeout(90)
def test_trainer_with_a_loader_worker_sees_the_same_batches():
    task = load_task("synthetic", SMALL)
    shard = DataShard(seed=2)
    reference, _ = hand_loop(task, shard, 10)
    with make_trainer(task, shard, num_workers=1, worker_start_method="fork") as trainer:
        trainer.run(max_steps=10)
    assert_same_parameters(trainer.model, reference)


def test_runs_continue_where_they_stopped():
    task = load_task("synthetic", SMALL)
    reference, _ = hand_loop(task, DataShard(), 12)
    trainer = make_trainer(task, DataShard())
    assert trainer.run(max_steps=5).num_steps == 5
    assert trainer.run(max_steps=12).num_steps == 7
    assert trainer.run(max_steps=12).num_steps == 0
    trainer.close()
    trainer.close()
    assert_same_parameters(trainer.model, reference)


def test_stop_event_and_time_limit():
    task = load_task("synthetic", SMALL)
    trainer = make_trainer(task, DataShard())
    stop = threading.Event()

    def on_step(report: StepReport) -> None:
        if report.step == 3:
            stop.set()

    result = trainer.run(stop_event=stop, on_step=on_step)
    assert result.stopped_by == "stop_event" and result.num_steps == 3
    assert trainer.run(max_time_s=0.0).stopped_by == "max_time"
    result = trainer.run(max_time_s=0.05)
    assert result.stopped_by == "max_time" and result.num_steps >= 1


class Finite(IterableDataset):
    def __iter__(self):
        for i in range(4):
            yield torch.full((2, 3), float(i)), torch.zeros(2, 1)


def test_finite_data_ends_the_run():
    task = Task(
        name="finite",
        build_model=lambda: torch.nn.Linear(3, 1),
        train_data=lambda shard: Finite(),
        loss_fn=torch.nn.functional.mse_loss,
        batch_size=2,
        yields_batches=True,
    )
    model = task.build_model()
    hook = RecordingHook()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    result = Trainer(task, model, sgd, shard=DataShard(), hook=hook).run()
    assert result.stopped_by == "data_exhausted" and result.num_steps == 4
    assert hook.contexts[-1].step == 4


class RecordingHook:
    """Accumulates two steps' gradients, then steps: what a collaborative hook does."""

    def __init__(self) -> None:
        self.contexts: list[StepContext] = []

    def on_step(self, context: StepContext) -> None:
        self.contexts.append(context)
        assert all(p.grad is not None for p in context.model.parameters())
        with context.clock.phase("allreduce"):
            pass
        if context.step % 2 == 0:
            context.optimizer.step()
            context.optimizer.zero_grad()


def test_custom_hook_gets_each_step_and_phases_are_marked():
    task = load_task("synthetic", SMALL)
    clock = PhaseClock()
    model = task.build_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = RecordingHook()
    trainer = Trainer(task, model, sgd, shard=DataShard(), clock=clock, hook=hook, config=FLOAT32)
    trainer.run(max_steps=6)
    assert [c.step for c in hook.contexts] == list(range(1, 7))
    assert all(c.batch_samples == 16 and c.loss.requires_grad is False for c in hook.contexts)
    # The reference: SGD on the sum of each pair of batches' mean-loss gradients.
    reference = task.build_model().to(DEVICE)
    reference_sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = list(itertools.islice(task.make_loader(DataShard()), 6))
    for step, (inputs, targets) in enumerate(batches, start=1):
        task.loss_fn(reference(inputs.to(DEVICE)), targets.to(DEVICE)).backward()
        if step % 2 == 0:
            reference_sgd.step()
            reference_sgd.zero_grad()
    assert_same_parameters(model, reference)
    snapshot = clock.snapshot()
    for phase in ("data", "forward", "backward", "optimizer", "allreduce"):
        assert snapshot.seconds[phase] > 0, phase
    assert sum(snapshot.seconds.values()) == pytest.approx(snapshot.wall_s, rel=1e-9)


def test_evaluate_matches_a_hand_computation():
    task = load_task("synthetic", SMALL)
    model = task.build_model()
    with torch.no_grad():
        losses = [task.loss_fn(model(x), y) for x, y in task.eval_batches()]
    assert evaluate(task, model) == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)
    assert model.training


def test_trainer_config_validation():
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        TrainerConfig(num_workers=-1)
    with pytest.raises(ValueError, match="worker_start_method must be one of"):
        TrainerConfig(worker_start_method="clone")
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        TrainerConfig(max_grad_norm=0.0)


def test_device_selection_and_cpu_no_ops():
    assert select_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device(None).type == expected == select_device("auto").type
    with pytest.raises(ValueError, match="not a device name"):
        select_device("quantum")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda")
    cpu = torch.device("cpu")
    amp = Amp(cpu, "auto")
    assert not amp.enabled and amp.scaler is None and amp.state_dict() == {}
    loss = torch.tensor(2.0)
    assert amp.scale(loss) is loss
    with amp.autocast():
        assert not torch.is_autocast_enabled()
    batch = (torch.ones(2), torch.zeros(2))
    assert to_device(batch, cpu) is batch and not use_pinned_memory(cpu)
    with pytest.raises(ValueError, match="amp must be one of"):
        Amp(cpu, "fp8")


def test_baseline_reports_throughput_and_accumulates():
    task = load_task("synthetic", SMALL)
    result = run_baseline(task, seconds=0.3, num_threads=1, total_batch_size=64)
    assert result.samples_per_s > 0 and math.isfinite(result.final_loss)
    assert result.samples_per_s == pytest.approx(result.num_samples / result.seconds)
    assert result.num_optimizer_steps == result.num_samples // 64
    every_step = run_baseline(task, seconds=0.1, num_threads=1)
    assert every_step.num_optimizer_steps == every_step.num_samples // 16
    assert torch.get_num_threads() == 1


def test_a_baseline_trained_in_two_stretches_equals_one_trained_in_one():
    # peer bench train runs its baseline half before and half after the swarm
    task = load_task("synthetic", SMALL)
    whole = BaselineRun(task, num_threads=1, total_batch_size=32)
    whole.train(max_steps=6)
    halves = BaselineRun(task, num_threads=1, total_batch_size=32)
    halves.train(max_steps=3)
    halves.train(max_steps=6)
    for a, b in zip(whole.model.parameters(), halves.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [n for n, _ in halves.stretches] == [3 * 32, 3 * 32]
    result = halves.result()
    assert result.num_optimizer_steps == 6 and result.num_samples == 6 * 32
    assert [seen for seen, _ in result.curve] == [32 * k for k in range(1, 7)]
    assert result.seconds == pytest.approx(sum(s for _, s in halves.stretches))
    with pytest.raises(ValueError, match="seconds > 0 or max_steps"):
        halves.train()
