"""What a training task is, how its data reaches the trainer, and how a task is found by name.

A :class:`Task` gives the model (a factory, so that every peer builds the same initial
parameters), the training data for one peer's shard, the loss, and optionally an evaluation set.
Batches are ``(inputs, targets)`` pairs of tensors: the model is called as ``model(inputs)``, the
loss as ``loss_fn(outputs, targets)``, and the number of samples in a batch is
``len(targets)``.

Tasks are found by :func:`load_task`: the built-ins ``synthetic``, ``charlm`` and ``images``, or
a user's ``package.module:function`` (or ``path/to/file.py:function``) that returns a
:class:`Task`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

Batch = tuple[torch.Tensor, torch.Tensor]
BUILTIN_TASKS: dict[str, str] = {
    "synthetic": "peer.train.tasks.synthetic:make_task",
    "charlm": "peer.train.tasks.charlm:make_task",
    "images": "peer.train.tasks.images:make_task",
}


class TaskError(ValueError):
    """A task cannot be found or built: unknown name, bad option, unreadable data."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataShard:
    """Which part of the data one peer reads.

    Attributes:
        index: this peer's shard, in ``[0, count)``.
        count: the number of shards the data is split into (map-style datasets are partitioned
            by it; generated data only mixes ``index`` into its seed).
        seed: the run's data seed; the same ``(index, count, seed)`` gives the same batches.
    """

    index: int = 0
    count: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise TaskError(f"DataShard.count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise TaskError(f"DataShard.index must be in [0, {self.count}), got {self.index}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """A training task: model, data, loss and an optional evaluation set.

    Attributes:
        name: a short name for logs and metrics.
        build_model: returns a freshly initialised model; deterministic, so that peers agree.
        train_data: given this peer's :class:`DataShard`, an infinite dataset. A map-style
            ``Dataset`` is sampled without replacement within the shard, epoch after epoch; an
            ``IterableDataset`` must shard itself (see :func:`worker_generator`).
        loss_fn: ``loss_fn(outputs, targets)`` -> scalar mean loss of the batch.
        batch_size: samples per local step.
        yields_batches: the iterable dataset yields whole ``(inputs, targets)`` batches
            (cheapest: no per-sample collation) instead of single samples.
        eval_batches: returns the evaluation batches (the same every call), or None.
        description: one line for logs.
    """

    name: str
    build_model: Callable[[], nn.Module]
    train_data: Callable[[DataShard], Dataset | IterableDataset]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    yields_batches: bool = False
    eval_batches: Callable[[], Iterable[Batch]] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise TaskError(f"task {self.name!r}: batch_size must be >= 1, got {self.batch_size}")

    def make_loader(
        self, shard: DataShard, *, num_workers: int = 0, pin_memory: bool = False, **kwargs: Any
    ) -> DataLoader:
        """A DataLoader over this peer's shard; ``kwargs`` go to ``DataLoader`` as they are."""
        dataset = self.train_data(shard)
        options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory, **kwargs}
        if isinstance(dataset, IterableDataset):
            batch_size = None if self.yields_batches else self.batch_size
            return DataLoader(dataset, batch_size=batch_size, **options)
        sampler = ShardSampler(len(dataset), shard)  # type: ignore[arg-type]
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, **options)


class ShardSampler(Sampler[int]):
    """Endless indices of one shard: a fresh seeded permutation every pass over the data."""

    def __init__(self, num_items: int, shard: DataShard):
        if num_items < shard.count:
            raise TaskError(f"dataset has {num_items} items, fewer than {shard.count} shards")
        self.num_items = num_items
        self.shard = shard

    def __iter__(self) -> Iterator[int]:
        epoch = 0
        while True:
            generator = torch.Generator().manual_seed(mix_seed(self.shard.seed, epoch))
            order = torch.randperm(self.num_items, generator=generator)
            yield from order[self.shard.index :: self.shard.count].tolist()
            epoch += 1


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from several integers (order matters)."""
    state = np.random.SeedSequence([p & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2)
    return (int(state[0]) << 32 | int(state[1])) & 0x7FFF_FFFF_FFFF_FFFF


def worker_generator(shard: DataShard, salt: int = 0) -> torch.Generator:
    """The RNG an iterable dataset should draw from: distinct per shard, seed and loader worker.

    Call it inside ``__iter__`` (it reads the DataLoader worker id there), so every worker of
    every peer draws a different stream, and the same shard, seed and worker the same one.
    """
    info = get_worker_info()
    worker_id = 0 if info is None else info.id
    return torch.Generator().manual_seed(mix_seed(shard.seed, shard.index, worker_id, salt))


def seeded_build(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module under a fixed seed without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def load_task(name_or_path: str, options: Mapping[str, Any] | None = None) -> Task:
    """Resolve a task by name and build it with ``options``.

    Args:
        name_or_path: ``synthetic``, ``charlm``, ``images``, ``package.module:function`` or
            ``path/to/file.py:function``; the function is called with the options as keyword
            arguments and must return a :class:`Task`.
        options: task options; strings are converted to the built-in tasks' field types, so
            ``{"n_layer": "4"}`` from a command line works.

    Raises:
        TaskError: unknown task, import failure, unknown or invalid option, unreadable data.
    """
    options = dict(options or {})
    target = BUILTIN_TASKS.get(name_or_path, name_or_path)
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskError(
            f"unknown task {name_or_path!r}: use one of {known} or 'package.module:function'"
        )
    module_name, _, function_name = target.rpartition(":")
    factory = getattr(_import(module_name, name_or_path), function_name, None)
    if not callable(factory):
        raise TaskError(f"task {name_or_path!r}: {module_name} has no function {function_name!r}")
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as e:
        raise TaskError(f"task {name_or_path!r} does not accept these options: {e}") from None
    try:
        task = factory(**options)
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"task {name_or_path!r} failed to build: {type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise TaskError(f"task {name_or_path!r}: {target} returned {type(task).__name__}, not Task")
    return task


def _import(module_name: str, task_name: str) -> types.ModuleType:
    if module_name.endswith(".py") or "/" in module_name:
        return _import_file(Path(module_name), task_name)
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise TaskError(
            f"task {task_name!r}: cannot import {module_name}: {type(e).__name__}: {e}"
        ) from e


def _import_file(path: Path, task_name: str) -> types.ModuleType:
    if not path.is_file():
        raise TaskError(f"task {task_name!r}: no such file {path}")
    module_name = f"_vp_task_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"task {task_name!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered so that DataLoader workers started with spawn can unpickle its classes.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise TaskError(f"task {task_name!r}: {path} failed: {type(e).__name__}: {e}") from e
    return module


def parse_options(cls: type, options: Mapping[str, Any], task_name: str) -> Any:
    """Build the options dataclass ``cls`` from ``options``, converting strings to field types.

    Raises:
        TaskError: an option ``cls`` does not have, a value of the wrong type, or the dataclass's
            own validation (``__post_init__`` raising ValueError) failing.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise TaskError(
            f"task {task_name!r} has no option {', '.join(unknown)}; "
            f"its options are: {', '.join(fields)}"
        )
    hints = typing.get_type_hints(cls)
    values = {
        name: _convert(value, hints[name], task_name, name) for name, value in options.items()
    }
    try:
        return cls(**values)
    except TaskError:
        raise
    except ValueError as e:
        raise TaskError(f"task {task_name!r}: {e}") from None


def _convert(value: Any, hint: Any, task_name: str, field: str) -> Any:
    allowed = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    optional = type(None) in typing.get_args(hint)
    if isinstance(value, str) and optional and value.lower() in ("", "none", "null"):
        return None
    if value is None and optional:
        return value
    for kind in allowed:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
        elif kind is int and isinstance(value, (int, str)) and not isinstance(value, bool):
            try:
                return int(value)
            except ValueError:
                pass
        elif kind is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                pass
        elif kind is str and isinstance(value, str):
            return value
    expected = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise TaskError(f"task {task_name!r}: option {field} must be {expected}, got {value!r}")
