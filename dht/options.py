"""Options every networked command shares (``peer join``, ``peer dht``, ``peer monitor``):
argument types whose bad values are one line and exit 2, URLs of peers, and the swarm key.

It lives in the lowest layer so that the dashboard, which may import only ``dht`` and
``peer.records``, reads the same definitions as the training peer.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dht.errors import BadMessageError, ConfigError
from dht.net.schema import parse_address

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


# a hivemind multiaddr with a TCP port (what hivemind scripts print): /ip4/HOST/tcp/PORT[/...]
MULTIADDR_PATTERN = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(/.*)?$")


def parse_multiaddr(text: object) -> tuple[str, int, str] | None:
    """``(host, port, scheme)`` of a multiaddr ``/ip4/HOST/tcp/PORT[/...]`` (``ip6``, ``dns``
    too; ``https`` when it goes on with ``/https`` or ``/tls``; the rest is ignored), or None."""
    match = MULTIADDR_PATTERN.match(str(text))
    if not match:
        return None
    rest = match.group(4) or ""
    scheme = "https" if rest.startswith(("/https", "/tls")) else "http"
    return match.group(2), int(match.group(3)), scheme


def multiaddr_url(text: object) -> str | None:
    """``http://host:port`` of a multiaddr (:func:`parse_multiaddr`), or None."""
    parsed = parse_multiaddr(text)
    if parsed is None:
        return None
    host, port, scheme = parsed
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def peer_url(url: str) -> str:
    """``url`` without a trailing slash, if it is ``http(s)://host:port`` (the rule every address
    from the network is held to, :func:`dht.net.schema.parse_address`); a multiaddr a hivemind
    script printed (:func:`multiaddr_url`) is taken as its URL.

    Raises:
        ValueError: it is neither.
    """
    url = multiaddr_url(url) or url
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


@dataclass(frozen=True, kw_only=True)
class NetworkOption:
    """One option every networked command spells the same way.

    Attributes:
        flag: the command-line flag.
        help: what it means (``peer join --help`` and ``peer dht --help`` print it).
        default: its value when not given.
        metavar: the placeholder in help (None: argparse's).
        many: it takes a list of values.
    """

    flag: str
    help: str
    default: Any = None
    metavar: str | None = None
    many: bool = False


# The one definition of the network options (``peer join`` builds its flags from PeerConfig,
# whose fields take their defaults and help from here; ``peer dht`` and ``peer monitor`` add
# the ones they use with :func:`add_network_args`).
NETWORK_OPTIONS: dict[str, NetworkOption] = {
    "host": NetworkOption(flag="--host", help="interface to listen on", default="127.0.0.1"),
    "port": NetworkOption(flag="--port", help="TCP port; 0 picks a free one", default=0),
    "announce_host": NetworkOption(
        flag="--announce-host", help="host that others use to reach this node (default: --host)"
    ),
    "source_host": NetworkOption(
        flag="--source-host",
        help="local IP address to make outgoing connections from (default: the system's "
        "choice); several peers on one machine, each on an address of its own, are one "
        "source each to the limits others keep per address",
    ),
    "initial_peers": NetworkOption(
        flag="--initial-peers",
        help="URLs of nodes already in the swarm (http://host:port)",
        metavar="URL",
        many=True,
    ),
    "identity": NetworkOption(
        flag="--identity",
        help="Ed25519 key file, created (mode 0600) on first run; default: a fresh identity",
        metavar="FILE",
    ),
    "swarm_key_file": NetworkOption(
        flag="--swarm-key-file",
        help="shared secret of a private swarm (or env VP_SWARM_KEY); requests without its "
        "HMAC are refused",
        metavar="FILE",
    ),
    "tls_cert": NetworkOption(
        flag="--tls-cert", help="serve HTTPS with this PEM cert", metavar="FILE"
    ),
    "tls_key": NetworkOption(flag="--tls-key", help="private key of --tls-cert", metavar="FILE"),
    "tls_ca": NetworkOption(
        flag="--tls-ca", help="CA bundle to verify other nodes' HTTPS certificates", metavar="FILE"
    ),
    "no_relay": NetworkOption(
        flag="--no-relay",
        help="relay for no one (by default a node that serves relays for peers others cannot "
        "reach, within --max-relayed-bytes-per-s)",
        default=False,
    ),
    "max_relayed_bytes_per_s": NetworkOption(
        flag="--max-relayed-bytes-per-s",
        help="bytes per second this node relays for others, both ways, all together",
        default=12.5e6,
        metavar="BYTES",
    ),
}


def add_network_args(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...] = tuple(NETWORK_OPTIONS),
    *,
    required: tuple[str, ...] = (),
    help_of: dict[str, str] | None = None,
) -> None:
    """Add the network options ``names`` to ``parser`` (in a group of their own).

    Args:
        parser: the command's parser.
        names: which options (keys of :data:`NETWORK_OPTIONS`).
        required: those of them that must be given.
        help_of: a command's own wording of some options' help.
    """
    group = parser.add_argument_group("network")
    for name in names:
        option = NETWORK_OPTIONS[name]
        text = (help_of or {}).get(name, option.help)
        kwargs: dict[str, Any] = {"metavar": option.metavar, "help": text}
        if option.many:
            kwargs.update(nargs="+" if name in required else "*", default=[])
        elif isinstance(option.default, bool):
            kwargs.update(action="store_true", default=option.default)
            kwargs.pop("metavar")
        elif isinstance(option.default, float):
            kwargs.update(
                type=positive_float, default=option.default, help=f"{text} (default: %(default)s)"
            )
        elif isinstance(option.default, int):
            kwargs.update(type=int, default=option.default, help=f"{text} (default: %(default)s)")
        else:
            kwargs.update(default=option.default)
            if option.default is not None:
                kwargs["help"] = f"{text} (default: %(default)s)"
        if name in required:
            kwargs["required"] = True
        group.add_argument(option.flag, **kwargs)
