"""The arguments of ``peer.Optimizer``, checked and turned into the settings ``peer join`` uses
(:class:`peer.run.config.PeerConfig`), so that a library peer and a ``peer join`` peer of the
same run agree on every setting they share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from peer.run.config import PeerConfig
from peer.swarm.state_sync import StateSyncConfig

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
