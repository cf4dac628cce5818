"""The DHT's three messages as Python values, and their wire forms.

Messages (msgpack maps; ids travel as 20 raw bytes, values as the writer's packed bytes; the
schema, strict, is in :mod:`dht.net.schema`):

* ``dht.ping``  ``{addr}`` -> ``{peer_id, addr}``
* ``dht.find``  ``{addr, key, value: bool}`` -> ``{peer_id, nodes: {peer_id: url}, entry}``
  where ``entry`` is None, ``["p", value, expiration]`` or
  ``["d", [[subkey, value, expiration, signature]...]]``
* ``dht.store`` ``{addr, records: [[key, subkey, value, expiration, signature]...]}`` ->
  ``{peer_id, accepted: [bool...], nodes}`` (nodes closest to the first record's key, so that
  stores double as the last round of a lookup); a record that fails validation refuses the
  whole request (422), one over ``max_value_bytes`` or malformed too (400).

``addr`` is the sender's URL (None for a client-mode node, which is never added to routing
tables).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from dht.errors import BadMessageError
from dht.kademlia.routing import PeerInfo
from dht.kademlia.storage import Entry, Record, Subkey
from dht.net import schema


@dataclass(frozen=True)
class StoreRequest:
    """One record to store under ``key_id`` (and ``subkey`` for a dictionary value)."""

    key_id: int
    subkey: Subkey | None
    record: Record


@dataclass(frozen=True)
class StoreAnswer:
    """A node's answer to ``dht.store``: which records it took, and its closest nodes."""

    accepted: list[bool]
    peers: list[PeerInfo]


@dataclass(frozen=True)
class FindAnswer:
    """A node's answer to ``dht.find``: its closest known nodes and what it holds."""

    peers: list[PeerInfo]
    entry: Entry | None


def encode_entry(entry: Entry | None) -> list | None:
    if entry is None:
        return None
    if isinstance(entry, Record):
        return ["p", entry.value_bytes, entry.expiration_time]
    return ["d", [[sk, r.value_bytes, r.expiration_time, r.signature] for sk, r in entry.items()]]


def decode_entry(wire: tuple | None, max_value_bytes: int) -> Entry | None:
    """An entry from its schema-checked wire form; BadMessageError if a value is too big."""
    if wire is None:
        return None
    if wire[0] == "p":
        return Record(checked_value(wire[1], max_value_bytes), wire[2])
    entry = {
        subkey: Record(checked_value(value, max_value_bytes), expiration, signature)
        for subkey, value, expiration, signature in wire[1]
    }
    return entry or None


def checked_value(value: bytes, max_value_bytes: int) -> bytes:
    """``value``; BadMessageError if it is over ``max_value_bytes``."""
    if len(value) > max_value_bytes:
        raise BadMessageError(f"value of {len(value)} bytes exceeds max_value_bytes")
    return value


def decode_peers(nodes: dict[str, str], schemes: tuple[str, ...]) -> list[PeerInfo]:
    """Nodes of a schema-checked answer; BadMessageError if one has another scheme."""
    return [_peer_info(peer_id, address, schemes) for peer_id, address in nodes.items()]


@lru_cache(maxsize=16384)
def same_host(address: str, remote_host: str) -> bool:
    """Whether ``address`` (a node URL) names the host ``remote_host`` (a connection's source
    IP; the in-memory transport gives the caller's own address)."""
    if address == remote_host:
        return True
    try:
        claimed = ipaddress.ip_address(urlsplit(address).hostname or "")
        source = ipaddress.ip_address(remote_host)
    except ValueError:
        return False  # a DNS name: only a ping back can tell
    claimed = getattr(claimed, "ipv4_mapped", None) or claimed
    source = getattr(source, "ipv4_mapped", None) or source
    return claimed == source


@lru_cache(maxsize=16384)
def _peer_info(peer_id: str, address: str, schemes: tuple[str, ...]) -> PeerInfo:
    # Every find answer names up to k nodes, mostly the same ones: check and hash each once.
    schema.parse_address(address, schemes)
    return PeerInfo.of(peer_id, address)
