"""Swarm membership (an HMAC under the shared swarm key) and stream frame tags.

Identity is proven by :mod:`dht.net.session`; the swarm key, when a swarm has one, is the proof of
membership on top of it: a hello (the handshake that makes a session) carries
``x-vp-mac = HMAC-SHA256(swarm key, "hello", sha256(body))``, and the swarm key salts every session
key, so no request of a non-member verifies.

With a swarm key every stream frame also carries a 16-byte tag: HMAC-SHA256 under the session key
over the request nonce, the direction, the frame number, the frame header and the payload, so
frames cannot be altered, dropped, reordered or moved to another stream.
"""

from __future__ import annotations

import hashlib
import hmac

from dht.errors import AuthError

FRAME_TAG_BYTES = 16


def body_digest(body: bytes | memoryview) -> bytes:
    return hashlib.sha256(body).digest()


class SwarmAuth:
    """Proves and checks membership with one swarm key.

    Args:
        key: the shared swarm key (at least 16 bytes).
    """

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise AuthError("swarm key must be at least 16 bytes")
        self.key = key

    def hello_mac(self, body: bytes) -> str:
        """The ``x-vp-mac`` of a hello whose body is ``body`` (hex)."""
        return hmac.new(self.key, b"hello" + body_digest(body), hashlib.sha256).hexdigest()

    def check_hello(self, body: bytes, mac_hex: str) -> None:
        """Raise :class:`AuthError` unless ``mac_hex`` is the hello's MAC under this key."""
        if not mac_hex:
            raise AuthError("missing swarm MAC")
        if not hmac.compare_digest(
            self.hello_mac(body).encode(), mac_hex.encode("ascii", "replace")
        ):
            raise AuthError("wrong swarm MAC")


class FrameTagger:
    """Tags the frames of one stream under its session key, bound to the request's nonce."""

    def __init__(self, key: bytes, nonce: str):
        self._key = key
        self._prefix = nonce.encode()

    def tag(self, direction: bytes, seq: int, header: bytes, payload) -> bytes:
        """The tag of frame ``seq`` (``direction`` is b"up" or b"down")."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(self._prefix + direction + seq.to_bytes(8, "little") + header)
        mac.update(payload)
        return mac.digest()[:FRAME_TAG_BYTES]

    @staticmethod
    def check(expected: bytes, given: bytes) -> None:
        if not hmac.compare_digest(expected, given):
            raise AuthError("stream frame MAC wrong")
