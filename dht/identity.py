"""Peer identity: an Ed25519 key pair whose public key is the peer id.

The peer id is the hex form of the 32-byte raw public key, so that anyone holding a peer id can
verify that peer's signatures without a lookup. The DHT node id is derived from it (see
:func:`dht.kademlia.routing.DHTID.from_peer_id`).

A peer id from the network must also be a *usable* key. OpenSSL (behind ``cryptography``) takes
any 32 bytes as an Ed25519 public key, and its verification is cofactorless: under a small-order
point (the 8 points of the curve's 8-torsion, such as the identity ``01 00 .. 00``) one
signature made without any private key verifies for every message, so anyone could prove such an
id and many could share it. :func:`public_key_problem` refuses those, non-canonical encodings
(``y >= p``, a "negative zero" ``x``) and bytes that are no point at all; no honest key is any of
them (a generated key is a multiple of the base point, of prime order).
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


# Ed25519 (RFC 8032): the field prime, the curve constant d, and sqrt(-1) mod p.
_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _decode_point(raw: bytes) -> tuple[int, int] | str:
    """The affine point ``raw`` encodes, or why it is refused (RFC 8032 5.1.3, strictly)."""
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    sign = raw[31] >> 7
    if y >= _P:
        return "a non-canonical encoding (y >= p)"
    u, v = (y * y - 1) % _P, (_D * y * y + 1) % _P
    x = u * pow(v, 3, _P) * pow(u * pow(v, 7, _P), (_P - 5) // 8, _P) % _P
    if v * x * x % _P == (-u) % _P:
        x = x * _SQRT_M1 % _P
    elif v * x * x % _P != u:
        return "not a point of the curve"
    if x == 0 and sign:
        return "a non-canonical encoding (negative zero x)"
    return (x if x & 1 == sign else _P - x), y


def _double(point: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    # Addition of extended coordinates (X, Y, Z, T) on -x^2 + y^2 = 1 + d x^2 y^2, point + point.
    x, y, z, t = point
    a, b = (y - x) * (y - x) % _P, (y + x) * (y + x) % _P
    c, d = 2 * t * t * _D % _P, 2 * z * z % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


@functools.lru_cache(maxsize=65536)
def public_key_problem(peer_id: str) -> str | None:
    """Why ``peer_id`` cannot be an honest Ed25519 public key, or None if it can.

    Refused: ids that are not 64 lowercase hex characters, non-canonical encodings, bytes that
    are no curve point, and the 8 small-order points (``[8]P`` is the identity), under which
    signatures can be forged without a private key. Cached (peer ids repeat).
    """
    if not is_peer_id(peer_id):
        return "not 64 lowercase hex characters"
    decoded = _decode_point(bytes.fromhex(peer_id))
    if isinstance(decoded, str):
        return decoded
    x, y = decoded
    point = (x, y, 1, x * y % _P)
    for _ in range(3):
        point = _double(point)
    if point[0] % _P == 0 and (point[1] - point[2]) % _P == 0:
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
