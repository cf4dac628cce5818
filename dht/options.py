"""Options every networked command shares (``peer join``, ``peer dht``, ``peer monitor``):
argument types whose bad values are one line and exit 2, URLs of peers, and the swarm key.

It lives in the lowest layer so that the dashboard, which may import only ``dht`` and
``peer.records``, reads the same definitions as the training peer.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dht.errors import BadMessageError, ConfigError
from dht.schema import parse_address

ENV_PREFIX = "VP_"


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def peer_url(url: str) -> str:
    """``url`` without a trailing slash, if it is ``http(s)://host:port`` (the rule every address
    from the network is held to, :func:`dht.schema.parse_address`).

    Raises:
        ValueError: it is not.
    """
    try:
        return parse_address(url.rstrip("/") if isinstance(url, str) else url)
    except BadMessageError as e:
        raise ValueError(f"{url!r} is not a URL like http://host:port ({e})") from None


def read_swarm_key(path: str | Path | None) -> bytes | None:
    """The swarm key from ``path``, else from ``VP_SWARM_KEY``, else None.

    Raises:
        ConfigError: the file cannot be read.
    """
    if path is not None:
        try:
            return Path(path).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"--swarm-key-file: cannot read {path}: {e}") from e
    key = os.environ.get(f"{ENV_PREFIX}SWARM_KEY")
    return key.encode() if key else None
