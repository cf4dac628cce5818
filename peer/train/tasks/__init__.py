"""Training tasks: the model, data, loss and evaluation set a peer trains on."""

from peer.train.tasks.base import (
    BUILTIN_TASKS,
    Batch,
    DataShard,
    Task,
    TaskError,
    load_task,
    parse_options,
    seeded_build,
    worker_generator,
)

__all__ = [
    "BUILTIN_TASKS",
    "Batch",
    "DataShard",
    "Task",
    "TaskError",
    "load_task",
    "parse_options",
    "seeded_build",
    "worker_generator",
]
