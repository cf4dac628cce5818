"""The strict schema of the DHT's RPC bodies: what :mod:`dht.kademlia.protocol` accepts from the
network.

Every request and answer of ``dht.ping``, ``dht.find``, ``dht.store`` and ``dial_back``
(:mod:`dht.reach.reachability`) is parsed here before the
node reads a field of it: exact field sets (unknown fields refused), exact types (no int for a
str, no bool for an int), sizes (ids 20 bytes, peer ids 64 hex characters, signatures 64 bytes,
subkeys at most :data:`MAX_SUBKEY_BYTES`), finite expirations in range, and node addresses that
are ``http(s)://host:port`` URLs (:func:`parse_address`). What fails raises
:class:`dht.errors.BadMessageError` with the first problem found; it is answered 400 (a request)
or counted as a failed contact (an answer).
"""

from __future__ import annotations

import ipaddress
import math
import re
from functools import lru_cache
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, PlainValidator
from pydantic import ValidationError as PydanticError

from dht.errors import BadMessageError
from dht.identity import SIGNATURE_BYTES, is_peer_id

ID_BYTES = 20  # a Kademlia id on the wire (160 bits; dht.kademlia.routing computes with it)
MAX_ADDRESS_CHARS = 256
MAX_HOST_CHARS = 64
MAX_SUBKEY_BYTES = 256
MAX_RECORDS_PER_STORE = 64
# Unix seconds as doubles are exact below 2^53; nothing expires that far ahead anyway.
MAX_EXPIRATION = float(2**53)
HTTP_SCHEMES = ("http", "https")
_MEM_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A relayed peer's address: its relay's URL, then this path (see dht/reach/relay_server.py).
_RELAYED_PATH = re.compile(r"/v2/relay/[0-9a-f]{64}")
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def is_relayed_path(path: str) -> bool:
    """Whether ``path`` is the path part of a relayed peer's address (``/v2/relay/{peer id}``)."""
    return _RELAYED_PATH.fullmatch(path) is not None


def parse_address(text: object, schemes: tuple[str, ...] = HTTP_SCHEMES) -> str:
    """``text`` if it is a node URL: ``scheme://host:port`` with nothing else, or a relayed
    peer's address ``scheme://host:port/v2/relay/{peer id}`` (64 lowercase hex).

    The host is an IP address (IPv6 in brackets) or a DNS name; the port is 1..65535; a
    user, query, fragment or any other path is refused. The in-memory transport's ``mem://N``
    is accepted when ``schemes`` includes ``mem``.

    Raises:
        BadMessageError: it is not.
    """
    if not isinstance(text, str) or not 0 < len(text) <= MAX_ADDRESS_CHARS:
        raise BadMessageError("address must be a URL of at most 256 characters")
    return _parse_address(text, schemes)


@lru_cache(maxsize=16384)  # every find answer names up to k nodes, mostly the same ones
def _parse_address(text: str, schemes: tuple[str, ...]) -> str:
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise BadMessageError(f"address {text[:64]!r} is not a URL: {e}") from None
    if parts.scheme not in schemes:
        raise BadMessageError(f"address scheme must be one of {', '.join(schemes)}")
    if parts.scheme == "mem":
        if not _MEM_NAME.fullmatch(parts.netloc) or parts.path or parts.query or parts.fragment:
            raise BadMessageError("address must be mem://NAME")
        return text
    path_ok = not parts.path or is_relayed_path(parts.path)
    if parts.username is not None or not path_ok or parts.query or parts.fragment:
        raise BadMessageError(
            "address must be scheme://host:port (or scheme://host:port/v2/relay/PEER_ID) "
            "and nothing else"
        )
    if port is None or not 0 < port <= 65535:
        raise BadMessageError("address must name a port in 1..65535")
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host) or host.replace(".", "").isdigit():
            raise BadMessageError(f"address host {host[:64]!r} is not an IP or DNS name") from None
    return text


def _peer_id(value: Any) -> str:
    if not is_peer_id(value):
        raise ValueError("must be a peer id (64 lowercase hex characters)")
    return value


def _address(value: Any) -> str:
    try:
        return parse_address(value)
    except BadMessageError as e:
        raise ValueError(str(e)) from None


def _mem_or_http_address(value: Any) -> str:
    try:
        return parse_address(value, (*HTTP_SCHEMES, "mem"))
    except BadMessageError as e:
        raise ValueError(str(e)) from None


def _key_id(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != ID_BYTES:
        raise ValueError(f"must be {ID_BYTES} bytes")
    return value


def _subkey(value: Any) -> str | bytes | int:
    if isinstance(value, bool) or not isinstance(value, str | bytes | int):
        raise ValueError("must be str, bytes or int")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        raise ValueError("int subkey out of the msgpack range")
    if isinstance(value, str | bytes) and len(value) > MAX_SUBKEY_BYTES:
        raise ValueError(f"longer than {MAX_SUBKEY_BYTES}")
    return value


def _expiration(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    if not (math.isfinite(value) and 0 < value < MAX_EXPIRATION):
        raise ValueError("must be finite, positive and below 2^53")
    return float(value)


def _signature(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) != SIGNATURE_BYTES:
        raise ValueError(f"must be None or {SIGNATURE_BYTES} bytes")
    return value


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 65535:
        raise ValueError("must be an int in 1..65535")
    return value


def _ip_or_empty(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_HOST_CHARS:
        raise ValueError(f"must be a str of at most {MAX_HOST_CHARS} characters")
    if value:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("must be an IP address or empty") from None
    return value


def _bytes(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError("must be bytes")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be a bool")
    return value


PeerId = Annotated[str, PlainValidator(_peer_id)]
Address = Annotated[str, PlainValidator(_mem_or_http_address)]
KeyId = Annotated[bytes, PlainValidator(_key_id)]
SubkeyField = Annotated[str | bytes | int, PlainValidator(_subkey)]
Expiration = Annotated[float, PlainValidator(_expiration)]
Signature = Annotated[bytes | None, PlainValidator(_signature)]
Value = Annotated[bytes, PlainValidator(_bytes)]
Flag = Annotated[bool, PlainValidator(_bool)]
Port = Annotated[int, PlainValidator(_port)]
HostIp = Annotated[str, PlainValidator(_ip_or_empty)]
StoredItem = tuple[SubkeyField, Value, Expiration, Signature]
PlainEntry = tuple[Literal["p"], Value, Expiration]
DictEntry = tuple[Literal["d"], list[StoredItem]]
StoreItem = tuple[KeyId, SubkeyField | None, Value, Expiration, Signature]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PingRequest(_Message):
    addr: Address | None


class FindRequest(_Message):
    addr: Address | None
    key: KeyId
    value: Flag


class StoreRequest(_Message):
    addr: Address | None
    records: list[StoreItem]


class PingAnswer(_Message):
    peer_id: PeerId
    addr: Address | None


class FindAnswer(_Message):
    peer_id: PeerId
    nodes: dict[PeerId, Address]
    entry: PlainEntry | DictEntry | None = None


class StoreAnswer(_Message):
    peer_id: PeerId
    accepted: list[Flag]
    nodes: dict[PeerId, Address]


class DialBackRequest(_Message):
    """Dial me back at my source IP on ``port`` (``tls``: with HTTPS)."""

    port: Port
    tls: Flag = False


class DialBackAnswer(_Message):
    """Whether the caller proved itself at ``observed_host:port``; the host it was seen from."""

    reachable: Flag
    observed_host: HostIp


def parse(model: type[_Message], obj: Any, *, max_nodes: int = 40, max_entry_records: int = 8192):
    """``obj`` (an unpacked msgpack message) as ``model``, or BadMessageError naming the fault.

    Args:
        max_nodes: the most nodes an answer may name (records and accepted flags are bounded
            by :data:`MAX_RECORDS_PER_STORE`).
        max_entry_records: the most records a find answer's entry may carry (counted before
            any is parsed: a flood costs nothing more than its unpacking).
    """
    limits = {"records": MAX_RECORDS_PER_STORE, "accepted": MAX_RECORDS_PER_STORE}
    for name, limit in (*limits.items(), ("nodes", max_nodes)):
        items = obj.get(name) if isinstance(obj, dict) else None
        if isinstance(items, list | dict) and len(items) > limit:
            raise BadMessageError(f"{name}: more than {limit}")
    entry = obj.get("entry") if isinstance(obj, dict) else None
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list):
        if len(entry[1]) > max_entry_records:
            raise BadMessageError(f"entry: more than {max_entry_records} records")
    try:
        return model.model_validate(obj)
    except PydanticError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or model.__name__
        raise BadMessageError(f"{model.__name__}.{where}: {first['msg']}") from None
