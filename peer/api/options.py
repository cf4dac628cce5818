"""The arguments of ``peer.Optimizer``, checked and turned into the settings ``peer join`` uses
(:class:`peer.run.config.PeerConfig`), so that a library peer and a ``peer join`` peer of the
same run agree on every setting they share."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationError

from averaging.config import check_prefix
from peer.api.dht import DHT
from peer.api.errors import (
    AVERAGER_OPTIONS,
    OPTIMIZER_OPTIONS,
    TRACKER_OPTIONS,
    check_hivemind_options,
)
from peer.run.config import PeerConfig
from peer.swarm.state_sync_config import StateSyncConfig

# hivemind compression classes (by name: hivemind need not be installed) -> our wire format
_GRAD_COMPRESSION = {
    "NoCompression": "none",
    "Float16Compression": "fp16",
    "ScaledFloat16Compression": "fp16",
    "Uint8Quantization": "uint8",
    "BlockwiseQuantization": "uint8",
}
_STATE_COMPRESSION = {"NoCompression": "none"}
# PeerConfig fields whose argument has another name here (a message names the argument)
ARGUMENT_OF_FIELD = {
    "compression": "grad_compression",
    "state_compression": "load_state_compression",
    "delay_update": "delay_optimizer_step",
}


class LibraryConfig(PeerConfig):
    """``peer join``'s settings plus what only the library sets."""

    load_state_timeout: float = Field(
        600.0, gt=0, description="seconds for one download of the swarm's state"
    )

    def state_sync_config(self) -> StateSyncConfig:
        return StateSyncConfig(
            compression=self.state_compression, download_timeout_s=self.load_state_timeout
        )


def compression_name(value: Any, *, argument: str, names: dict[str, str]) -> str:
    """Our name of a compression given as a string or a hivemind compression object.

    Raises:
        ValueError: naming ``argument``.
    """
    if value is None:
        return "none"
    if isinstance(value, str):
        if value in names.values():
            return value
        raise ValueError(f"{argument}: one of {sorted(set(names.values()))}, got {value!r}")
    kind = type(value).__name__
    if kind in names:
        return names[kind]
    raise ValueError(f"{argument}: one of {sorted(set(names.values()))} or hivemind's {kind}")


def grad_compression(value: Any) -> str:
    """The wire format of rounds for ``grad_compression=value``."""
    return compression_name(value, argument="grad_compression", names=_GRAD_COMPRESSION)


def state_compression(value: Any) -> str:
    """The state download format for ``load_state_compression=value``."""
    names = {**_STATE_COMPRESSION, "bf16": "bf16"}
    return compression_name(value, argument="load_state_compression", names=names)


def positive(name: str, value: Any, *, allow_none: bool = False, integer: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a positive number."""
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{name}: {what}, got {value!r}")


def make_config(**fields: Any) -> LibraryConfig:
    """Validate ``fields`` as :class:`LibraryConfig`.

    Raises:
        ValueError: one line naming the argument (with our API's name for it).
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    for name in ("metrics_file", "trace"):
        if name in fields and not isinstance(fields[name], str | Path):
            raise ValueError(f"{name}: a path, got {fields[name]!r}")
    try:
        return LibraryConfig(**fields)
    except ValidationError as e:
        error = e.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:
            raise ValueError(message) from None
        field = str(error["loc"][0])
        raise ValueError(f"{ARGUMENT_OF_FIELD.get(field, field)}: {message}") from None


def check_arguments(
    *,
    dht: Any,
    run_id: Any,
    target_batch_size: Any,
    batch_size_per_step: Any,
    scheduler: Any,
    matchmaking_time: Any,
    averaging_timeout: Any,
    load_state_timeout: Any,
    reuse_grad_buffers: bool,
    delay_optimizer_step: Any,
    use_local_updates: bool,
    client_mode: Any,
    grad_compression: Any,
    state_averaging_compression: Any,
    load_state_compression: Any,
    shutdown_timeout: Any,
    mode: Any,
    outer_lr: Any,
    outer_momentum: Any,
    options: dict[str, Any],
) -> tuple[LibraryConfig, bool]:
    """Check ``peer.Optimizer``'s arguments (``options``: its ``**kwargs``).

    Returns:
        The settings, and whether to print the profiler's table at shutdown.

    Raises:
        TypeError: an argument that does not exist here.
        ValueError: a bad value, naming the argument.
    """
    summary = options.pop("summary", True)
    ours = {name: options.pop(name) for name in _OURS if name in options}
    _take_hivemind_dicts(options, ours)
    delay_grad_averaging = options.pop("delay_grad_averaging", False)
    check_hivemind_options("peer.Optimizer", options, OPTIMIZER_OPTIONS)
    if delay_optimizer_step is None:  # hivemind's default: delayed when the averaging is
        delay_optimizer_step = bool(delay_grad_averaging)
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError("delay_grad_averaging: True needs delay_optimizer_step=True (as hivemind)")
    _check_dht(dht, client_mode)
    positive("batch_size_per_step", batch_size_per_step, allow_none=True, integer=True)
    positive("shutdown_timeout", shutdown_timeout)
    for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name}: a number >= 0, got {value!r}")
    try:
        check_prefix(run_id)
    except ValueError as e:
        raise ValueError(f"run_id: {e}") from None
    mode = _resolve_mode(mode, use_local_updates)
    compression = _compressions(grad_compression, state_averaging_compression)
    if delay_optimizer_step and mode != "grad":
        hint = " (diloco overlaps its rounds with diloco_overlap=True)" if mode == "diloco" else ""
        raise ValueError(f"delay_optimizer_step: needs mode='grad', not {mode!r}{hint}")
    if ours.get("diloco_overlap") and mode != "diloco":
        raise ValueError(f"diloco_overlap: needs mode='diloco', not {mode!r}")
    if reuse_grad_buffers and mode != "grad":
        raise ValueError(f"reuse_grad_buffers: needs mode='grad', not {mode!r}")
    config = make_config(
        run_id=run_id,
        target_batch_size=target_batch_size,
        mode=mode,
        delay_update=bool(delay_optimizer_step),
        compression=compression,
        state_compression=state_compression(load_state_compression),
        matchmaking_time=matchmaking_time,
        averaging_timeout=averaging_timeout,
        load_state_timeout=load_state_timeout,
        client_mode=dht.client_mode,
        **ours,
    )
    if scheduler is not None and not (hasattr(scheduler, "step") or callable(scheduler)):
        raise ValueError(f"scheduler: a scheduler or a factory, got {scheduler!r}")
    if scheduler is not None and config.lr_schedule != "constant":
        raise ValueError("scheduler: pass either scheduler= or lr_schedule=, not both")
    return config, summary


# peer join's settings a library peer takes as keyword arguments (PeerConfig fields)
_OURS = (
    "diloco_overlap",
    "min_round_interval",
    "target_group_size",
    "min_group_size",
    "newcomer_wait",
    "split_wait",
    "min_deadline",
    "publish_interval",
    "wait_for_peers",
    "wait_for_peers_timeout",
    "lr_schedule",
    "warmup_epochs",
    "schedule_epochs",
    "min_lr_ratio",
    "metrics_file",
    "metrics_interval",
    "trace",
    "trace_max_mb",
    "profile_interval",
    "profile_window",
)


def _take_hivemind_dicts(options: dict[str, Any], ours: dict[str, Any]) -> None:
    """hivemind's ``averager_opts`` and ``tracker_opts``: the group sizes become ours, the rest
    is checked as hivemind's (:mod:`peer.api.errors`).

    Raises:
        TypeError: a key neither hivemind's averager (tracker) nor ours takes, or a refused value.
        ValueError: a dict that is not one, or a group size given twice.
    """
    for name, table, owner in (
        ("averager_opts", AVERAGER_OPTIONS, "averager_opts"),
        ("tracker_opts", TRACKER_OPTIONS, "tracker_opts"),
    ):
        given = options.pop(name, None)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise ValueError(f"{name}: a dict of keyword arguments, got {type(given).__name__}")
        given = dict(given)
        if name == "averager_opts":
            for size in ("target_group_size", "min_group_size"):
                if size in given and size in ours:
                    raise ValueError(f"{size}: given both here and in averager_opts")
                if size in given and given[size] is not None:
                    ours[size] = given.pop(size)
                given.pop(size, None)
        check_hivemind_options(owner, given, table)


def _check_dht(dht: Any, client_mode: bool | None) -> None:
    if not isinstance(dht, DHT):
        raise ValueError(f"dht: a running peer.DHT, got {type(dht).__name__}")
    if not dht.is_alive():
        raise ValueError("dht: this peer.DHT was shut down")
    if dht.attached_run is not None:
        raise ValueError(f"dht: it already serves run {dht.attached_run!r}; one Optimizer per DHT")
    if client_mode is not None and bool(client_mode) != dht.client_mode:
        raise ValueError(
            f"client_mode: {client_mode} but the DHT has client_mode={dht.client_mode}; "
            "set it on peer.DHT (or leave it None here)"
        )


def _resolve_mode(mode: str | None, use_local_updates: bool) -> str:
    if mode is None:
        return "params" if use_local_updates else "grad"
    if mode not in ("grad", "params", "diloco"):
        raise ValueError(f"mode: 'grad', 'params' or 'diloco', got {mode!r}")
    if use_local_updates and mode != "params":
        raise ValueError(f"use_local_updates: True means mode='params', not mode={mode!r}")
    return mode


def _compressions(grad: Any, state: Any) -> str:
    compression = grad_compression(grad)
    if state is not None and grad_compression(state) != compression:
        raise ValueError(
            "state_averaging_compression: must equal grad_compression (one wire format for "
            "every round)"
        )
    return compression


def make_optimizer(optimizer: Any, params: Iterable[Any] | None) -> torch.optim.Optimizer:
    """The wrapped optimizer: ``optimizer`` itself, or ``optimizer(list(params))``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if params is not None:
            raise ValueError("params: only with an optimizer factory (the instance has them)")
        return optimizer
    if not callable(optimizer):
        raise ValueError(f"optimizer: an optimizer or a factory, got {type(optimizer).__name__}")
    if params is None:
        raise ValueError("params: required when optimizer is a factory")
    params = list(params)
    if not params:
        raise ValueError("params: empty")
    made = optimizer(params)
    if not isinstance(made, torch.optim.Optimizer):
        raise ValueError(f"optimizer: the factory returned {type(made).__name__}")
    return made


def make_scheduler(
    scheduler: Any, optimizer: torch.optim.Optimizer, epoch: int, *, wrapper: Any = None
) -> Any:
    """The scheduler (made by the factory if one is given), set to ``epoch``; it may schedule
    the wrapped ``optimizer`` or its ``wrapper`` (the same param groups)."""
    if scheduler is None:
        return None
    if not hasattr(scheduler, "step"):
        if not callable(scheduler):
            raise ValueError(f"scheduler: a scheduler or a factory, got {scheduler!r}")
        scheduler = scheduler(optimizer)
    if getattr(scheduler, "optimizer", optimizer) not in (optimizer, wrapper):
        raise ValueError("scheduler: it schedules another optimizer than this one wraps")
    scheduler.last_epoch = epoch  # a downloaded state came with its epoch's LR
    return scheduler


def log_to_stderr() -> None:
    """``verbose=True``: INFO lines of ``peer`` reach stderr even where logging is not set up."""
    # like hivemind's verbose=True: the lines show even where logging is not configured
    root = logging.getLogger("peer")
    if not logging.getLogger().handlers and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
