"""``peer.DHT``'s arguments: addresses (URLs or hivemind multiaddrs) and hivemind's keyword
arguments that ``hivemind.DHT`` passes on to its node and its libp2p daemon, each mapped to
our setting where one means the same (:data:`MAPPED`) and otherwise accepted or refused by
:data:`peer.api.errors.DHT_OPTIONS`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dht.identity import PeerIdentity
from dht.options import parse_multiaddr, peer_url
from peer.api.errors import DHT_OPTIONS, check_hivemind_options

logger = logging.getLogger(__name__)
_NOTED: set[str] = set()  # hivemind's per-call keyword arguments already explained at INFO

# hivemind's argument -> (where: "dht" DHTConfig, "transport" TransportConfig, "own" a
# peer.DHT argument; our name); a value None means hivemind's default
MAPPED: dict[str, tuple[str, str]] = {
    "bucket_size": ("dht", "bucket_size"),
    "num_replicas": ("dht", "num_replicas"),
    "wait_timeout": ("dht", "rpc_timeout_s"),
    "cache_size": ("dht", "cache_max_entries"),
    "nat_port_map": ("own", "port_mapping"),
    "use_relay": ("own", "relay"),
    "use_relay_hop": ("own", "relay"),
    "no_listen": ("own", "client_mode"),
}


def is_tcp_maddr(addr: Any) -> bool:
    """Whether ``addr`` is a TCP multiaddr (hivemind lists UDP/QUIC ones beside them)."""
    return parse_multiaddr(addr) is not None


def as_url(addr: Any, *, argument: str) -> str:
    """An address as a URL: a multiaddr (a string or an object) becomes ``http://host:port``.

    Raises:
        ValueError: naming ``argument``, when it is neither.
    """
    try:
        return peer_url(str(addr))
    except ValueError as e:
        raise ValueError(f"{argument}: {e}") from None


def initial_urls(addrs: Sequence[Any] | None, *, argument: str) -> list[str]:
    """The URLs of ``addrs``; hivemind's non-TCP multiaddrs (``/udp/.../quic``) are left out
    with one INFO line, as long as a TCP address or a URL remains.

    Raises:
        ValueError: naming ``argument``: one string instead of a list, or a bad address.
    """
    if addrs is None:
        return []
    if isinstance(addrs, str | bytes):
        raise ValueError(f"{argument}: a list of addresses, not one string")
    addrs = list(addrs)
    kept = [a for a in addrs if not _is_other_maddr(a)]
    if len(kept) < len(addrs):
        if addrs and not kept:
            raise ValueError(f"{argument}: no TCP address among {[str(a) for a in addrs]}")
        logger.info("%s: non-TCP multiaddrs left out (this swarm speaks HTTP over TCP)", argument)
    urls = [as_url(a, argument=argument) for a in kept]
    return list(dict.fromkeys(urls))  # hivemind lists a peer once per transport


def _is_other_maddr(addr: Any) -> bool:
    text = str(addr)
    return text.startswith("/") and "/udp/" in text and parse_multiaddr(text) is None


def listen_address(host: str, port: int, host_maddrs: Sequence[Any] | None) -> tuple[str, int]:
    """Where to listen: ``host``/``port``, or the first TCP multiaddr of ``host_maddrs``.

    Raises:
        ValueError: naming the argument.
    """
    if host_maddrs:
        if isinstance(host_maddrs, str):
            raise ValueError("host_maddrs: a list of multiaddrs, not one string")
        tcp = [parse_multiaddr(m) for m in host_maddrs if is_tcp_maddr(m)]
        if not tcp:
            raise ValueError(f"host_maddrs: no /ip4/HOST/tcp/PORT among {list(host_maddrs)}")
        if len(tcp) < len(host_maddrs):
            logger.info("host_maddrs: listening on TCP only (this swarm speaks HTTP over TCP)")
        host, port = tcp[0][0], tcp[0][1]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port: an integer in 0..65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host: an interface name or address, got {host!r}")
    return host, port


def hivemind_settings(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """hivemind's node and daemon arguments: ``(DHTConfig fields, peer.DHT arguments)`` for
    those that mean the same as one of ours; the others are checked by
    :func:`peer.api.errors.check_hivemind_options`.

    Raises:
        TypeError: an argument hivemind does not have either, or a refused value.
    """
    dht_fields: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for name in list(kwargs):
        if name not in MAPPED:
            continue
        value = kwargs.pop(name)
        where, ours = MAPPED[name]
        if value is None:
            continue
        if where == "dht":
            dht_fields[ours] = value
        else:  # all booleans of the same sense (no_listen=True: client_mode=True)
            own[ours] = bool(value)
    check_hivemind_options("peer.DHT", kwargs, DHT_OPTIONS)
    return dht_fields, own


def note_node_kwargs(method: str, kwargs: dict[str, Any]) -> None:
    for name in kwargs:
        if f"{method}.{name}" not in _NOTED:
            _NOTED.add(f"{method}.{name}")
            logger.info(
                "peer.DHT.%s: hivemind's %s= has no effect here (one lookup per call)", method, name
            )


def with_hivemind_names(message: str, given: dict[str, Any]) -> str:
    """A config error naming hivemind's argument beside our field it set."""
    for name, (_, ours) in MAPPED.items():
        if name in given and ours in message:
            return f"{name} ({ours}): {message}"
    return message


def relay_cap(max_relayed_bytes_per_s: float | None) -> dict[str, float]:
    """The transport's keyword for the relay cap (none: the transport's default)."""
    if max_relayed_bytes_per_s is None:
        return {}
    return {"max_relayed_bytes_per_s": max_relayed_bytes_per_s}


def check_identity(identity: Any, identity_path: Any) -> None:
    if identity is None:
        return
    if not isinstance(identity, PeerIdentity):
        raise ValueError(f"identity: a dht.identity.PeerIdentity, got {type(identity).__name__}")
    if identity_path is not None:
        raise ValueError("identity: give identity or identity_path, not both")
