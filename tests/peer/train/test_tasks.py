"""Tasks: the built-ins learn, shards differ, user tasks load, bad input is one clear error."""

from __future__ import annotations

import itertools
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from peer.train.tasks import DataShard, Task, TaskError, load_task
from peer.train.tasks.charlm import STDLIB_VOCAB
from peer.train.tasks.gpt import GPT, GPTConfig

pytestmark = pytest.mark.timeout(60)
SHAKESPEARE = Path(__file__).resolve().parents[4] / "shared" / "data" / "tinyshakespeare.txt"
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "batch_size": 16}


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def take(task: Task, shard: DataShard, count: int, **loader_options) -> list:
    return list(itertools.islice(task.make_loader(shard, **loader_options), count))


def eval_loss(task: Task, model: torch.nn.Module) -> float:
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(x).flatten(0, -2), y.flatten()) for x, y in task.eval_batches()
        ]
    return float(torch.stack(losses).mean())


def train(task: Task, num_steps: int, lr: float) -> torch.nn.Module:
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for inputs, targets in take(task, DataShard(), num_steps):
        optimizer.zero_grad()
        task.loss_fn(model(inputs), targets).backward()
        optimizer.step()
    return model


def test_synthetic_defaults_are_the_bench_contract():
    task = load_task("synthetic")
    model = task.build_model()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 512), (512, 512), (512, 10)]
    assert sum(p.numel() for p in model.parameters()) == 669_706
    inputs, targets = take(task, DataShard(), 1)[0]
    assert inputs.shape == (32, 784) and targets.shape == (32,) and task.batch_size == 32
    assert targets.dtype == torch.int64 and 0 <= targets.min() and targets.max() < 10


@pytest.mark.timeout(90)
def test_synthetic_loss_decreases():
    task = load_task("synthetic")
    initial = eval_loss(task, task.build_model())
    # Uniform over 10 classes at initialisation, give or take.
    assert abs(initial - math.log(10)) < 0.2
    final = eval_loss(task, train(task, 200, lr=1e-3))
    assert final < 0.8 * initial


def test_models_are_identical_across_builds_and_leave_global_rng_alone():
    task = load_task("synthetic", {"hidden_dim": 16})
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    first, second = task.build_model(), task.build_model()
    assert torch.rand(1) == before
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    other = load_task("synthetic", {"hidden_dim": 16, "model_seed": 1}).build_model()
    assert not torch.equal(next(other.parameters()), next(first.parameters()))


@pytest.mark.parametrize("name", ["synthetic", "charlm"])
def test_shards_differ_and_repeat(name):
    options = {"max_chars": 5000, **TINY_GPT} if name == "charlm" else {"hidden_dim": 8}
    task = load_task(name, options)

    def batches(index: int, seed: int) -> list:
        return take(task, DataShard(index=index, count=4, seed=seed), 3)

    same = zip(batches(1, 5), batches(1, 5), strict=True)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in same)
    for other in (batches(2, 5), batches(1, 6)):
        assert not any(torch.equal(a[0], b[0]) for a, b in zip(batches(1, 5), other, strict=True))


@pytest.mark.timeout(60)
def test_loader_workers_draw_distinct_streams():
    task = load_task("synthetic", {"hidden_dim": 8})
    shard = DataShard(seed=3)
    single = take(task, shard, 2)
    workers = take(task, shard, 4, num_workers=2, multiprocessing_context="fork")
    # Workers alternate; worker 0 draws what the in-process loader draws, worker 1 something else.
    assert torch.equal(workers[0][0], single[0][0]) and torch.equal(workers[2][0], single[1][0])
    assert not torch.equal(workers[1][0], workers[0][0])


def test_gpt_forward_shapes_and_tied_head():
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config)
    logits = model(torch.randint(0, 11, (3, 8)))
    assert logits.shape == (3, 8, 11)
    assert model(torch.randint(0, 11, (2, 5))).shape == (2, 5, 11)
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(vocab_size=11, n_head=3, n_embd=16)


def test_gpt_is_causal():
    model = GPT(GPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=1, n_embd=8)).eval()
    tokens = torch.randint(0, 7, (1, 6))
    changed = tokens.clone()
    changed[0, 4] = (tokens[0, 4] + 1) % 7
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :4], b[:, :4]) and not torch.equal(a[:, 4:], b[:, 4:])


def text_file(tmp_path: Path) -> Path:
    """Shakespeare when the shared data is there, else the standard library's text."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE
    from peer.train.tasks.charlm import stdlib_text

    path = tmp_path / "corpus.txt"
    path.write_text(stdlib_text(200_000), encoding="utf-8")
    return path


@pytest.mark.timeout(90)
def test_charlm_learns_below_uniform_guess(tmp_path):
    options = {"path": str(text_file(tmp_path)), "max_chars": 100_000, **TINY_GPT}
    task = load_task("charlm", options)
    vocab_size = task.build_model().config.vocab_size
    uniform = math.log(vocab_size)
    initial = eval_loss(task, task.build_model())
    assert abs(initial - uniform) < 0.1  # small initial weights: near-uniform predictions
    final = eval_loss(task, train(task, 150, lr=3e-3))
    assert final < 0.8 * uniform


def test_charlm_default_corpus_is_the_standard_library():
    task = load_task("charlm", {"max_chars": 20_000, **TINY_GPT})
    assert "standard library" in task.description
    assert task.build_model().config.vocab_size == len(STDLIB_VOCAB) == 97
    inputs, targets = take(task, DataShard(), 1)[0]
    assert inputs.shape == targets.shape == (16, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_charlm_vocabulary_of_a_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("héllo wörld\n" * 200, encoding="utf-8")
    task = load_task("charlm", {"path": str(path), "block_size": 8, "n_layer": 1})
    assert task.build_model().config.vocab_size == len(set("héllo wörld\n"))


def test_string_options_are_converted(tmp_path):
    task = load_task("charlm", {"max_chars": "20000", "n_layer": "1", "bias": "true", "path": ""})
    model = task.build_model()
    assert len(model.blocks) == 1 and model.ln_f.bias is not None
    assert load_task("synthetic", {"batch_size": "8"}).batch_size == 8


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("imagenet", {}, "unknown task 'imagenet': use one of charlm, images, synthetic"),
        ("synthetic", {"widht": 3}, "task 'synthetic' has no option widht"),
        ("synthetic", {"hidden_dim": "wide"}, "option hidden_dim must be int, got 'wide'"),
        ("synthetic", {"batch_size": 0}, "option batch_size must be >= 1"),
        ("charlm", {"dropout": 1.5}, "option dropout must be in"),
        ("charlm", {"n_embd": 30, "n_head": 4}, "n_embd (30) must be a multiple"),
        ("charlm", {"path": "/nonexistent/x.txt"}, "cannot read text file /nonexistent/x.txt"),
        ("no_such_module_xyz:make", {}, "cannot import no_such_module_xyz"),
        ("peer.train.tasks.synthetic:nope", {}, "has no function 'nope'"),
    ],
)
def test_bad_input_is_one_task_error(name, options, message):
    with pytest.raises(TaskError) as info:
        load_task(name, options)
    assert message in str(info.value)


def test_unreadable_text_files(tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok\xff\xfe")
    with pytest.raises(TaskError, match=r"binary.txt is not UTF-8 text \(bad byte at offset 2\)"):
        load_task("charlm", {"path": str(binary)})
    with pytest.raises(TaskError, match="cannot read text file"):
        load_task("charlm", {"path": str(tmp_path)})
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(TaskError, match="too short for block_size 64"):
        load_task("charlm", {"path": str(short)})


USER_TASK = """
import torch
from torch.utils.data import Dataset
from peer.train.tasks import Task

class Squares(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, index):
        return torch.tensor([float(index)]), torch.tensor([float(index) ** 2])

def make(width=4, scale=1.0):
    if width < 1:
        raise ValueError("width must be positive")
    return Task(
        name="squares",
        build_model=lambda: torch.nn.Sequential(
            torch.nn.Linear(1, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        ),
        train_data=lambda shard: Squares(),
        loss_fn=torch.nn.functional.mse_loss,
        batch_size=5,
    )

def not_a_task():
    return 42
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "vp_user_task.py").write_text(textwrap.dedent(USER_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "vp_user_task.py"


def test_user_task_loads_from_module_and_file(user_module):
    task = load_task("vp_user_task:make", {"width": 3})
    assert task.name == "squares" and task.build_model()[0].out_features == 3
    from_file = load_task(f"{user_module}:make")
    assert from_file.build_model()[0].out_features == 4


def test_user_map_dataset_is_partitioned_between_shards(user_module):
    task = load_task("vp_user_task:make")
    seen = []
    for index in range(2):
        batches = take(task, DataShard(index=index, count=2, seed=9), 4)  # one pass: 20 items
        seen.append({int(x) for inputs, _ in batches for x in inputs.flatten()})
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(40))


@pytest.mark.parametrize(
    ("options", "target", "message"),
    [
        ({"depth": 2}, "make", "does not accept these options"),
        ({"width": 0}, "make", "failed to build: ValueError: width must be positive"),
        ({}, "not_a_task", "returned int, not Task"),
    ],
)
def test_user_task_errors(user_module, options, target, message):
    with pytest.raises(TaskError, match=message):
        load_task(f"vp_user_task:{target}", options)


def test_data_shard_validation():
    with pytest.raises(TaskError, match=r"DataShard\.index must be in"):
        DataShard(index=2, count=2)
