"""Peer identity: an Ed25519 key pair whose public key is the peer id.

The peer id is the hex form of the 32-byte raw public key, so that anyone holding a peer id can
verify that peer's signatures without a lookup. The DHT node id is derived from it (see
:func:`dht.kademlia.routing.DHTID.from_peer_id`).

A peer id from the network must also be a *usable* key. OpenSSL (behind ``cryptography``) takes
any 32 bytes as an Ed25519 public key, and its verification is cofactorless: under a small-order
point (the 8 points of the curve's 8-torsion, such as the identity ``01 00 .. 00``) one
signature made without any private key verifies for every message, so anyone could prove such an
id and many could share it. :func:`public_key_problem` refuses those and non-canonical encodings
(``y >= p``, a "negative zero" ``x``); no honest key is either (a generated key is a multiple of
the base point, of prime order, written canonically).
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dht.errors import IdentityError

PEER_ID_HEX_LEN = 64
SIGNATURE_BYTES = 64


def is_peer_id(value: object) -> bool:
    """True if ``value`` is a well-formed peer id (64 lowercase hex characters)."""
    if not isinstance(value, str) or len(value) != PEER_ID_HEX_LEN:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return value == value.lower()


# Ed25519's field prime, and the y coordinates of its 8 small-order points: the identity
# (y = 1), the point of order 2 (y = -1), those of order 4 (y = 0) and of order 8 (y = +-Y8).
# Each y but 0 has two points (x and -x), told apart by the sign bit; x = 0 has one.
_P = 2**255 - 19
_Y8 = 0x5FC536D880238B13933C6D305ACDFD5F098EFF289F4C345B027B2C28F95E826
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _Y8, _P - _Y8})
_ZERO_X_Y = frozenset({1, _P - 1})  # points whose x is 0: a set sign bit is a "negative zero"


@functools.lru_cache(maxsize=65536)
def public_key_problem(peer_id: str) -> str | None:
    """Why ``peer_id`` cannot be an honest Ed25519 public key, or None if it can.

    Refused: ids that are not 64 lowercase hex characters, non-canonical encodings (``y >= p``,
    or ``x = 0`` with the sign bit set) and the 8 small-order points, under which signatures
    can be forged without a private key. (Bytes that are no point of the curve fail every
    verification already.) Cached: peer ids repeat.
    """
    if not is_peer_id(peer_id):
        return "not 64 lowercase hex characters"
    raw = bytes.fromhex(peer_id)
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    if y >= _P:
        return "a non-canonical encoding (y >= p)"
    if y in _ZERO_X_Y and raw[31] >> 7:
        return "a non-canonical encoding (negative zero x)"
    if y in _SMALL_ORDER_Y:
        return "a small-order point (signatures under it can be forged)"
    return None


def short_id(peer_id: str) -> str:
    """The first 8 characters of a peer id, for logs and tables."""
    return peer_id[:8]


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Check that ``signature`` over ``data`` was made by the owner of ``peer_id`` (never true
    under a key :func:`public_key_problem` refuses)."""
    if len(signature) != SIGNATURE_BYTES or public_key_problem(peer_id) is not None:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(peer_id)).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class PeerIdentity:
    """A peer's private key and the peer id derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        raw = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = raw.hex()

    @classmethod
    def generate(cls) -> PeerIdentity:
        """A fresh identity that lives only in memory."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> PeerIdentity:
        """Load the key in ``path``, or create it there (mode 0600) on first run.

        Raises:
            IdentityError: the file is unreadable, not an Ed25519 key, or readable by others.
        """
        path = Path(path)
        if not path.exists():
            identity = cls.generate()
            pem = identity._private_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return cls.load_or_create(path)  # another process created it first
            with os.fdopen(fd, "wb") as file:
                file.write(pem)
            return identity
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"identity file {path} is accessible by others (mode {mode:04o}); chmod 600 it"
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError, OSError) as e:
            raise IdentityError(f"identity file {path} is not a readable key: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"identity file {path} holds a {type(key).__name__}, not Ed25519")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        """An Ed25519 signature of ``data`` (64 bytes)."""
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"PeerIdentity({short_id(self.peer_id)})"
