"""The ``synthetic`` task: a fixed-seed teacher network labels random inputs.

Needs no files and has any size. Its defaults are the ``peer bench train`` contract: a student
MLP 784-512-512-10 (about 0.67M parameters), batches of 32, 10-class cross-entropy. Inputs are
drawn on the fly, a whole batch per draw from a per-shard generator, so data is never the
bottleneck and no large tensor is built up front.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from peer.train.tasks.base import (
    Batch,
    DataShard,
    Task,
    mix_seed,
    parse_options,
    seeded_build,
    worker_generator,
)

_EVAL_SALT = 0xE5A1
_TRAIN_SALT = 0x7EAC


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticOptions:
    """Options of the ``synthetic`` task.

    Attributes:
        input_dim: features per input (standard normal).
        hidden_dim: width of each hidden layer of the student.
        num_hidden_layers: hidden layers of the student (ReLU).
        num_classes: classes the teacher labels.
        batch_size: samples per local step.
        teacher_hidden_dim: width of the teacher's tanh layer; 0 makes the teacher linear.
        teacher_seed: seed of the teacher's weights (every peer must use the same).
        model_seed: seed of the student's initial weights.
        num_eval_batches: batches in the evaluation set.
        eval_batch_size: samples per evaluation batch.
    """

    input_dim: int = 784
    hidden_dim: int = 512
    num_hidden_layers: int = 2
    num_classes: int = 10
    batch_size: int = 32
    teacher_hidden_dim: int = 64
    teacher_seed: int = 1234
    model_seed: int = 0
    num_eval_batches: int = 8
    eval_batch_size: int = 256

    def __post_init__(self) -> None:
        for name in ("input_dim", "hidden_dim", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_hidden_layers", "teacher_hidden_dim", "num_eval_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"option {name} must be >= 0, got {getattr(self, name)}")
        if self.num_classes < 2:
            raise ValueError(f"option num_classes must be >= 2, got {self.num_classes}")


class Teacher:
    """The labelling network: ``argmax(tanh(x @ w1) @ w2)`` (or ``argmax(x @ w2)`` if linear)."""

    def __init__(self, options: SyntheticOptions):
        generator = torch.Generator().manual_seed(options.teacher_seed)
        width = options.teacher_hidden_dim
        self.w1: torch.Tensor | None = None
        if width:
            self.w1 = torch.randn(options.input_dim, width, generator=generator)
            self.w1 /= options.input_dim**0.5
        fan_in = width or options.input_dim
        self.w2 = torch.randn(fan_in, options.num_classes, generator=generator) / fan_in**0.5

    def label(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = inputs if self.w1 is None else torch.tanh(inputs @ self.w1)
        return (hidden @ self.w2).argmax(dim=1)


class TeacherDataset(IterableDataset):
    """Endless ``(inputs, labels)`` batches for one shard, labelled by the teacher."""

    def __init__(self, options: SyntheticOptions, shard: DataShard):
        super().__init__()
        self.options = options
        self.shard = shard
        self.teacher = Teacher(options)

    def __iter__(self) -> Iterator[Batch]:
        generator = worker_generator(self.shard, _TRAIN_SALT)
        shape = (self.options.batch_size, self.options.input_dim)
        while True:
            inputs = torch.randn(shape, generator=generator)
            yield inputs, self.teacher.label(inputs)


def build_student(options: SyntheticOptions) -> nn.Module:
    """The student MLP: ``input -> [hidden, ReLU] * num_hidden_layers -> classes``."""
    layers: list[nn.Module] = []
    width = options.input_dim
    for _ in range(options.num_hidden_layers):
        layers += [nn.Linear(width, options.hidden_dim), nn.ReLU()]
        width = options.hidden_dim
    layers.append(nn.Linear(width, options.num_classes))
    return nn.Sequential(*layers)


def eval_batches(options: SyntheticOptions) -> list[Batch]:
    """The evaluation set: fixed batches from a seed no training shard uses."""
    teacher = Teacher(options)
    generator = torch.Generator().manual_seed(mix_seed(options.teacher_seed, _EVAL_SALT))
    batches = []
    for _ in range(options.num_eval_batches):
        inputs = torch.randn(options.eval_batch_size, options.input_dim, generator=generator)
        batches.append((inputs, teacher.label(inputs)))
    return batches


def make_task(**options: Any) -> Task:
    """Build the ``synthetic`` task; see :class:`SyntheticOptions` for the options."""
    opts = parse_options(SyntheticOptions, options, "synthetic")
    return Task(
        name="synthetic",
        build_model=lambda: seeded_build(opts.model_seed, lambda: build_student(opts)),
        train_data=lambda shard: TeacherDataset(opts, shard),
        loss_fn=F.cross_entropy,
        batch_size=opts.batch_size,
        yields_batches=True,
        eval_batches=(lambda: eval_batches(opts)) if opts.num_eval_batches else None,
        description=(
            f"synthetic: MLP {opts.input_dim}-"
            + "-".join([str(opts.hidden_dim)] * opts.num_hidden_layers)
            + f"-{opts.num_classes} student of a fixed-seed teacher, batch {opts.batch_size}"
        ),
    )
