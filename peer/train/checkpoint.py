"""Atomic checkpoints of a peer's training state, in a format that never needs pickle.

One checkpoint is one safetensors file: the model's parameters and buffers (``model/<name>``),
the optimizer's state tensors and any tensors of the caller's extra state, plus JSON metadata
(the format, the progress counters, and the structure of the optimizer's ``state_dict`` and of
the extra state, with each tensor replaced by a reference to its name in the file).

A checkpoint is written to a temporary file in the same directory, flushed with fsync, renamed
over its final name (atomic on POSIX) and the directory fsynced, so a crash at any moment leaves
either the previous checkpoint or the new one, never a half-written file under a checkpoint's
name. Loading decodes and checks everything before touching the model, so a checkpoint that
does not fit never leaves a half-loaded model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)
FORMAT = "volunteer-peer-checkpoint/1"
_META_KEY = "volunteer_peer"
_NAME = re.compile(r"^checkpoint-(\d{8,})\.safetensors$")
_TEMP = re.compile(r"^\.checkpoint-\d{8,}\.safetensors\..*\.tmp$")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read (I/O error, truncated or corrupt file)."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint does not fit the model or optimizer it is loaded into."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """Training counters saved with the state.

    Attributes:
        epoch: global (swarm) epoch: optimizer steps of the collaborative run.
        step: local steps of this peer.
        samples: samples this peer has processed.
    """

    epoch: int = 0
    step: int = 0
    samples: int = 0


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides the model and optimizer.

    Attributes:
        path: the file read.
        progress: the saved counters.
        extra: the caller's extra state as saved (tensors on CPU), or None.
    """

    path: Path
    progress: Progress
    extra: Any


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    progress: Progress,
    extra: Any = None,
) -> None:
    """Write a checkpoint to ``path`` atomically.

    Args:
        path: the final file name; its directory must exist.
        model: whose ``state_dict`` (parameters and persistent buffers) to save.
        optimizer: whose ``state_dict`` to save, or None.
        progress: the counters.
        extra: more state (e.g. an LR scheduler's or a grad scaler's ``state_dict``): nested
            dicts, lists and tuples of tensors, str, int, float, bool and None.

    Raises:
        CheckpointError: the state holds another type, or writing failed (the previous file
            at ``path``, if any, is then untouched).
    """
    tensors, metadata = pack_state(model=model, optimizer=optimizer, progress=progress, extra=extra)
    path = Path(path)
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, temp_name, metadata=metadata)
        with open(temp_name, "rb+") as temp:
            os.fsync(temp.fileno())
        os.replace(temp_name, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        if isinstance(e, (OSError, safetensors.SafetensorError)):
            raise CheckpointError(f"cannot write checkpoint {path}: {e}") from e
        raise
    _fsync_directory(path.parent)


def load_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> LoadedCheckpoint:
    """Restore ``model`` (and ``optimizer``) from the checkpoint at ``path``.

    Raises:
        CheckpointError: the file is missing, truncated or not a checkpoint.
        CheckpointMismatchError: it does not fit ``model`` or ``optimizer``; neither was
            modified.
    """
    path = Path(path)
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (OSError, safetensors.SafetensorError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    progress, extra = unpack_state(tensors, metadata, model=model, optimizer=optimizer, path=path)
    return LoadedCheckpoint(path, progress, extra)


def pack_state(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    progress: Progress,
    extra: Any = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (CPU, contiguous, no shared memory) and the string metadata of a state."""
    tensors = {f"model/{name}": value for name, value in model.state_dict().items()}
    header = {
        "format": FORMAT,
        "progress": dataclasses.asdict(progress),
        "optimizer": None
        if optimizer is None
        else _encode(optimizer.state_dict(), tensors, "optim"),
        "extra": _encode(extra, tensors, "extra"),
    }
    return _plain_tensors(tensors), {_META_KEY: json.dumps(header)}


def unpack_state(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: Path | str = "<state>",
) -> tuple[Progress, Any]:
    """Check a packed state against ``model``/``optimizer``, then load it into them."""
    try:
        header = json.loads(metadata[_META_KEY])
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {FORMAT!r}")
        progress = Progress(**header["progress"])
        optimizer_state = _decode(header["optimizer"], tensors)
        extra = _decode(header["extra"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a valid checkpoint: {e}") from e
    model_state = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    _check_model(model, model_state, path)
    if optimizer is not None:
        if optimizer_state is None:
            raise CheckpointMismatchError(f"{path} holds no optimizer state")
        _check_optimizer(optimizer, optimizer_state, path)
    model.load_state_dict(model_state)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    return progress, extra


def _check_model(model: nn.Module, state: dict[str, torch.Tensor], path: Path | str) -> None:
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, value in expected.items():
        if value.shape != state[name].shape:
            raise CheckpointMismatchError(
                f"{path}: {name} has shape {tuple(state[name].shape)}, "
                f"the model's is {tuple(value.shape)}"
            )


def _check_optimizer(optimizer: torch.optim.Optimizer, state: Any, path: Path | str) -> None:
    try:
        saved = [len(group["params"]) for group in state["param_groups"]]
    except (KeyError, TypeError) as e:
        raise CheckpointMismatchError(f"{path}: malformed optimizer state: {e}") from None
    ours = [len(group["params"]) for group in optimizer.param_groups]
    if saved != ours:
        raise CheckpointMismatchError(
            f"{path}: optimizer has parameter groups of sizes {ours}, the checkpoint {saved}"
        )


def _plain_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share memory (tied weights, views): copy those.
    storages: set[int] = set()
    plain = {}
    for name, value in tensors.items():
        value = value.detach().to("cpu").contiguous()
        pointer = value.untyped_storage().data_ptr()
        if value.numel() and pointer in storages:
            value = value.clone()
        storages.add(value.untyped_storage().data_ptr())
        plain[name] = value
    return plain


def _encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """JSON-able structure; tensors move to ``tensors`` and are referenced by name."""
    if isinstance(value, torch.Tensor):
        name = f"{prefix}.{len(tensors)}"
        tensors[name] = value
        return {"T": name}
    if isinstance(value, dict):
        for key in value:
            if not (key is None or isinstance(key, (str, int, float, bool))):
                raise CheckpointError(f"cannot store a dict key of type {type(key).__name__}")
        return {"d": [[k, _encode(v, tensors, prefix)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        tag = "l" if isinstance(value, list) else "t"
        return {tag: [_encode(v, tensors, prefix) for v in value]}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise CheckpointError(f"cannot store a {type(value).__name__} in a checkpoint")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(value, dict):
        return value
    ((tag, body),) = value.items()
    if tag == "T":
        if body not in tensors:
            raise ValueError(f"tensor {body!r} is missing")
        return tensors[body]
    if tag == "d":
        return {key: _decode(item, tensors) for key, item in body}
    if tag in ("l", "t"):
        items = [_decode(item, tensors) for item in body]
        return items if tag == "l" else tuple(items)
    raise ValueError(f"unknown tag {tag!r}")


def _fsync_directory(directory: Path) -> None:
    # Makes the rename durable; not possible on every platform (e.g. Windows), hence optional.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointDir:
    """Numbered checkpoints in one directory (one writer): save, prune, load the newest.

    Args:
        directory: created if missing.
        keep: how many of the newest checkpoints to keep (>= 1).
    """

    def __init__(self, directory: str | Path, *, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {directory}: {e}") from e

    def paths(self) -> list[Path]:
        """Complete checkpoints, newest first (temporary files never count)."""
        return [entry for _, entry in self._numbered()]

    def _numbered(self) -> list[tuple[int, Path]]:
        numbered = []
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match:
                numbered.append((int(match.group(1)), entry))
        return sorted(numbered, reverse=True)

    def save(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        progress: Progress,
        extra: Any = None,
    ) -> Path:
        """Write the next checkpoint atomically, then drop temporaries and old checkpoints."""
        numbered = self._numbered()
        number = numbered[0][0] + 1 if numbered else 0
        path = self.directory / f"checkpoint-{number:08d}.safetensors"
        save_checkpoint(path, model=model, optimizer=optimizer, progress=progress, extra=extra)
        for stale in [*self.paths()[self.keep :], *self._temporaries()]:
            with contextlib.suppress(OSError):
                stale.unlink()
        return path

    def load_latest(
        self, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> LoadedCheckpoint | None:
        """Load the newest readable checkpoint; None if there is none at all.

        An unreadable (e.g. corrupted) checkpoint is skipped with a warning for the one before
        it. Raises CheckpointMismatchError if the newest readable one does not fit, and
        CheckpointError if checkpoints exist but none is readable.
        """
        paths = self.paths()
        for path in paths:
            try:
                return load_checkpoint(path, model=model, optimizer=optimizer)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                logger.warning("skipping unreadable checkpoint: %s", e)
        if paths:
            raise CheckpointError(f"none of the {len(paths)} checkpoints in {self.directory} loads")
        return None

    def _temporaries(self) -> list[Path]:
        return [entry for entry in self.directory.iterdir() if _TEMP.match(entry.name)]
