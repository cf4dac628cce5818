"""Checks of a downloaded state before it touches the model: what a donor cannot make us load.

A donor's state passed the download's layout check (:mod:`peer.swarm.state_sync`: the model's
tensors with exactly our dtypes and shapes, extra bytes capped) and its digest is one that enough
peers announce (:mod:`peer.records.state`). Here, before anything is loaded:

* every floating tensor is finite (no NaN or infinity, whatever its shape);
* the metadata is well typed: a checkpoint header of our format, its optimizer state a map from
  parameter index to named tensors or plain scalars, each optimizer tensor either the shape of
  its parameter or a scalar, every optimizer tensor sent used exactly once;
* the optimizer's hyperparameters are ours: the donor's ``param_groups`` (``lr``, betas, weight
  decay...) are replaced by the local optimizer's before loading;
* in ``params`` and ``diloco`` modes the optimizer state is not taken at all (each peer's inner
  optimizer is its own, and no digest covers it);
* in ``diloco`` the outer optimizer's state (its momentum, part of the replica every peer
  shares) is taken under ``extra``, checked as the optimizer's is, with the local outer
  optimizer's hyperparameters.

Every failure is a :class:`~peer.swarm.state_sync.StateRejected` (a ``StateSyncError``): the
downloader tries the next donor.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from peer.swarm.state_digest import OPTIMIZER_PREFIX
from peer.swarm.state_sync import StateRejected, StateSnapshot
from peer.train.checkpoint import FORMAT, Progress, pack_state

MAX_METADATA_CHARS = 1 << 20
# The prefix of the tensors of a packed state's ``extra`` (the outer optimizer's, in diloco).
EXTRA_PREFIX = "extra"
MAX_STATE_NAME_CHARS = 64


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Every floating tensor holds only finite values."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StateRejected(f"tensor {name[:80]} holds NaN or infinite values")


def parse_header(metadata: object, meta_key: str) -> dict[str, Any]:
    """The donor's checkpoint header, checked to be of our format."""
    if not isinstance(metadata, dict) or set(metadata) != {meta_key}:
        raise StateRejected("the state's metadata is not a checkpoint header")
    text = metadata[meta_key]
    if not isinstance(text, str) or len(text) > MAX_METADATA_CHARS:
        raise StateRejected("the state's header is not a string of at most 1 MiB")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise StateRejected(f"the state's header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise StateRejected(f"the state's header is not of format {FORMAT}")
    return header


def _entries(encoded: Any, what: str) -> list:
    if not (isinstance(encoded, dict) and set(encoded) == {"d"} and isinstance(encoded["d"], list)):
        raise StateRejected(f"the optimizer's {what} is not a map")
    for entry in encoded["d"]:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise StateRejected(f"the optimizer's {what} has a malformed entry")
    return encoded["d"]


def _scalar(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return abs(value) < 2**53
    return isinstance(value, float) and math.isfinite(value)


def check_optimizer_state(
    structure: Any,
    tensors: dict[str, torch.Tensor],
    params: list[torch.Tensor],
    prefix: str = OPTIMIZER_PREFIX,
) -> None:
    """The donor's optimizer ``structure`` (encoded ``state``) fits ``params``: see the module
    docstring. ``tensors`` are the downloaded ones (optimizer tensors under ``prefix``)."""
    used: set[str] = set()
    for index, per_param in _entries(structure, "state"):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            raise StateRejected(f"optimizer state for a parameter that does not exist: {index!r}")
        param = params[index]
        for name, value in _entries(per_param, "state of a parameter"):
            if not (isinstance(name, str) and len(name) <= MAX_STATE_NAME_CHARS):
                raise StateRejected("optimizer state names are short strings")
            if isinstance(value, dict) and set(value) == {"T"}:
                ref = value["T"]
                tensor = tensors.get(ref) if isinstance(ref, str) else None
                if tensor is None or not ref.startswith(prefix) or ref in used:
                    raise StateRejected(f"optimizer state {name[:32]!r} names no tensor sent")
                used.add(ref)
                if tensor.shape != param.shape and tensor.numel() != 1:
                    raise StateRejected(
                        f"optimizer state {name[:32]!r} of parameter {index} has shape "
                        f"{list(tensor.shape)}, the parameter {list(param.shape)}"
                    )
            elif not _scalar(value):
                raise StateRejected(f"optimizer state {name[:32]!r} is neither tensor nor scalar")
    unused = {n for n in tensors if n.startswith(prefix)} - used
    if unused:
        raise StateRejected(f"{len(unused)} optimizer tensors are not part of its state")


def _verified_optimizer(
    encoded: Any,
    tensors: dict[str, torch.Tensor],
    local: torch.optim.Optimizer,
    *,
    prefix: str,
    what: str,
) -> dict[str, Any]:
    """The donor's encoded optimizer state dict, checked against ``local``'s parameters, with
    ``local``'s hyperparameters (``param_groups``) instead of the donor's."""
    _, packed = pack_state(model=torch.nn.Module(), optimizer=local, progress=Progress())
    local_groups = dict(json.loads(next(iter(packed.values())))["optimizer"]["d"])["param_groups"]
    try:
        donor_state = dict(_entries(encoded, "state dict"))["state"]
    except KeyError:
        raise StateRejected(f"the state has no {what} state") from None
    params = [p for group in local.param_groups for p in group["params"]]
    check_optimizer_state(donor_state, tensors, params, prefix)
    return {"d": [["state", donor_state], ["param_groups", local_groups]]}


def loadable_metadata(
    snapshot: StateSnapshot,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    with_optimizer: bool,
    outer: torch.optim.Optimizer | None = None,
) -> dict[str, str]:
    """The metadata to load ``snapshot`` with, after every check of the module docstring: the
    donor's optimizer state (if taken) with the local hyperparameters, the donor's ``outer``
    optimizer state (``diloco``: under ``extra``, when ``outer`` is given) likewise, the
    verified epoch.

    Raises:
        StateRejected: a check failed.
    """
    _, local = pack_state(model=model, optimizer=None, progress=Progress())
    (meta_key,) = local
    header = parse_header(snapshot.metadata, meta_key)
    check_finite(snapshot.tensors)
    optimizer_header = extra_header = None
    if with_optimizer:
        optimizer_header = _verified_optimizer(
            header.get("optimizer"),
            snapshot.tensors,
            optimizer,
            prefix=OPTIMIZER_PREFIX,
            what="optimizer",
        )
    if outer is not None:
        extra_header = _verified_optimizer(
            header.get("extra"), snapshot.tensors, outer, prefix=EXTRA_PREFIX, what="outer"
        )
    verified = {
        "format": FORMAT,
        "progress": {"epoch": snapshot.epoch, "step": 0, "samples": 0},
        "optimizer": optimizer_header,
        "extra": extra_header,
    }
    return {meta_key: json.dumps(verified)}
