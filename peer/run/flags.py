"""Where ``peer join``'s settings come from: flags, a TOML file, the environment.

Precedence: command-line flags > ``--config FILE`` (TOML) > environment (``VP_<FIELD>``) >
defaults. Every :class:`~peer.run.config.PeerConfig` field is a flag (``--field-name``);
:func:`join_command` spells the inverse, a peer's command line from options.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import ValidationError

from dht.errors import ConfigError
from dht.options import ENV_PREFIX
from peer.run.config import PeerConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, with its description and default as help; defaults stay unset."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML file of these options (flags override it)",
    )
    for name, field in PeerConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "none" if default is None or default == [] else default
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": f"{field.description} (default: {shown})",
        }
        annotation = field.annotation
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(annotation) is list:
            kwargs["nargs"] = "*" if name == "initial_peers" else None
            if name != "initial_peers":
                kwargs["action"] = "append"
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = get_args(annotation)
        parser.add_argument(_flag(name), **kwargs)


def join_command(
    *, log_level: str = "WARNING", json_summary: bool = True, **options: Any
) -> list[str]:
    """The arguments of a ``python -m peer join`` process (after the interpreter) with these
    :class:`PeerConfig` options: the inverse of :func:`add_config_arguments`, the one place the
    demo, the train benchmark and the experiments spell a peer's command line.

    Args:
        log_level: the ``peer --log-level``.
        json_summary: end with the JSON summary line (``--json``).
        options: field names of :class:`PeerConfig` and their values; None leaves one unset.

    Raises:
        ConfigError: a name that is no option.
    """
    args = ["-m", "peer", "--log-level", log_level, "join"]
    for name, value in options.items():
        field = PeerConfig.model_fields.get(name)
        if field is None:
            raise ConfigError(f"peer join has no option {name!r}")
        if value is None:
            continue
        if field.annotation is bool:
            args.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        elif name == "initial_peers":
            args += [_flag(name), *map(str, value)]
        elif get_origin(field.annotation) is list:
            for item in value:
                args += [_flag(name), str(item)]
        else:
            args += [_flag(name), str(value)]
    if json_summary:
        args.append("--json")
    return args


def _from_env() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, field in PeerConfig.model_fields.items():
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw.split() if get_origin(field.annotation) is list else raw
    return values


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from e
    return {key.replace("-", "_"): value for key, value in data.items()}


def load_config(args: argparse.Namespace) -> PeerConfig:
    """Merge defaults < environment < TOML < flags and validate.

    Raises:
        ConfigError: one line naming the first invalid field.
    """
    values = _from_env()
    if getattr(args, "config", None) is not None:
        values.update(_from_toml(args.config))
    values.update({k: v for k, v in vars(args).items() if k in PeerConfig.model_fields})
    try:
        return PeerConfig(**values)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "extra_forbidden":
            raise ConfigError(f"unknown option {error['loc'][0]!r}") from None
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:  # a check across fields names its options itself
            raise ConfigError(message) from None
        raise ConfigError(f"{_flag(str(error['loc'][0]))}: {message}") from None
