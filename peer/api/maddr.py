"""Multiaddrs for ``peer.DHT.get_visible_maddrs()``: what hivemind's helpers take.

A peer's address here is a URL (``http://host:port``); hivemind scripts hand
``get_visible_maddrs()`` to ``choose_ip_address``, ``log_visible_maddrs``, ``str(m)`` or
``m.protocols()``. :func:`visible_maddrs` gives them multiaddr objects of the class they expect:

* ``hivemind.utils.multiaddr.Multiaddr`` when the script imported hivemind (its helpers check
  that class and build it from strings, bytes or another instance of it);
* else ``multiaddr.Multiaddr`` (py-multiaddr) when that package is installed;
* else :class:`Multiaddr` of this module: the part of py-multiaddr a hivemind user relies on
  (``str``, ``protocols()``, ``m[name]``, ``value_for_protocol``, ``name in m``,
  ``encapsulate``, ``decapsulate``, equality and hashing), no binary form.

Only ``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT[/https]`` stands for an address of ours; anything
after it (``/p2p/...``) is ignored where an address is read (:func:`peer.api.dht.as_url`).
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# name -> (multicodec code, whether a value follows); what this module's Multiaddr parses
_PROTOCOLS: dict[str, tuple[int, bool]] = {
    "ip4": (4, True),
    "tcp": (6, True),
    "udp": (273, True),
    "dns": (53, True),
    "dns4": (54, True),
    "dns6": (55, True),
    "ip6": (41, True),
    "p2p": (421, True),
    "p2p-circuit": (290, False),
    "quic": (460, False),
    "quic-v1": (461, False),
    "tls": (448, False),
    "http": (480, False),
    "https": (443, False),
    "ws": (477, False),
    "wss": (478, False),
}


@dataclass(frozen=True)
class Protocol:
    """One protocol of a multiaddr; equal to its name too (``"ip4" in m.protocols()``)."""

    code: int
    name: str

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, Protocol) and (other.code, other.name) == (self.code, self.name)

    def __hash__(self) -> int:
        return hash(self.name)


class Multiaddr:
    """A textual multiaddr (``/ip4/127.0.0.1/tcp/31337``), when neither hivemind nor
    py-multiaddr is installed.

    Raises:
        ValueError: naming the part that is not a known protocol or a valid value.
    """

    def __init__(self, addr: str | Multiaddr):
        text = str(addr)
        parts = text.split("/")
        if not text.startswith("/") or len(parts) < 2:
            raise ValueError(f"multiaddr: {text!r} does not start with '/'")
        pairs: list[tuple[str, str | None]] = []
        index = 1
        while index < len(parts):
            name = parts[index]
            if name not in _PROTOCOLS:
                raise ValueError(f"multiaddr: unknown protocol {name!r} in {text!r}")
            has_value = _PROTOCOLS[name][1]
            if has_value and index + 1 >= len(parts):
                raise ValueError(f"multiaddr: {name} needs a value in {text!r}")
            value = parts[index + 1] if has_value else None
            if value is not None:
                _check_value(name, value, text)
            pairs.append((name, value))
            index += 2 if has_value else 1
        self._pairs = tuple(pairs)

    def protocols(self) -> tuple[Protocol, ...]:
        """The protocols, in order (each equals its name)."""
        return tuple(Protocol(_PROTOCOLS[name][0], name) for name, _ in self._pairs)

    def value_for_protocol(self, name: str) -> str | None:
        """The value of the first ``name`` part (None for a protocol without one).

        Raises:
            KeyError: no part is ``name``.
        """
        for part, value in self._pairs:
            if part == name:
                return value
        raise KeyError(f"{name!r} is not in {self}")

    __getitem__ = value_for_protocol

    def __contains__(self, name: object) -> bool:
        return any(part == name for part, _ in self._pairs)

    def encapsulate(self, other: str | Multiaddr) -> Multiaddr:
        """This multiaddr followed by ``other``."""
        return Multiaddr(str(self) + str(Multiaddr(other)))

    def decapsulate(self, other: str | Multiaddr) -> Multiaddr:
        """This multiaddr up to the last occurrence of ``other`` (all of it if none)."""
        text, tail = str(self), str(Multiaddr(other))
        cut = text.rfind(tail)
        return Multiaddr(text[:cut]) if cut > 0 else Multiaddr(text)

    def __str__(self) -> str:
        return "".join(f"/{n}" + (f"/{v}" if v is not None else "") for n, v in self._pairs)

    def __repr__(self) -> str:
        return f"<Multiaddr {self}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Multiaddr) and other._pairs == self._pairs

    def __hash__(self) -> int:
        return hash(self._pairs)


def _check_value(name: str, value: str, text: str) -> None:
    try:
        if name == "ip4":
            ipaddress.IPv4Address(value)
        elif name == "ip6":
            ipaddress.IPv6Address(value)
        elif name in ("tcp", "udp") and not 0 <= int(value) <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"multiaddr: {value!r} is not a valid {name} in {text!r}") from None


def multiaddr_class() -> type:
    """The class hivemind's helpers expect (see the module's docstring)."""
    hivemind = sys.modules.get("hivemind.utils.multiaddr")
    if hivemind is not None:
        return hivemind.Multiaddr
    try:
        from multiaddr import Multiaddr as PyMultiaddr  # py-multiaddr, when installed
    except ImportError:
        return Multiaddr
    return PyMultiaddr


def url_as_maddr_text(url: str) -> str:
    """``/ip4|ip6|dns/HOST/tcp/PORT`` of ``http://HOST:PORT`` (``/https`` appended for TLS);
    the path of a relayed address (``{relay}/v2/relay/{id}``) is dropped: the relay's own
    address, through which the swarm is joined."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    try:
        kind = "ip4" if ipaddress.ip_address(host).version == 4 else "ip6"
    except ValueError:
        kind = "dns"
    return f"/{kind}/{host}/tcp/{port}" + ("/https" if parts.scheme == "https" else "")


def visible_maddrs(urls: list[str]) -> list[Any]:
    """The multiaddrs of ``urls``, of :func:`multiaddr_class`."""
    cls = multiaddr_class()
    return [cls(url_as_maddr_text(url)) for url in urls]
