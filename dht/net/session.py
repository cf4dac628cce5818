"""Proven identity: a signed handshake per (caller, node) pair that derives a session key.

A caller proves its Ed25519 key once per node in ``POST /v2/hello`` and gets a session back:

1. The caller sends ``{peer, eph, ts, nonce, sig}``: its peer id, a fresh X25519 public key,
   the time, 16 random bytes and its Ed25519 signature over the four.
2. The node checks the signature (and that the time is within a day of its own), makes its own
   X25519 key, and
   derives ``key = HKDF-SHA256(X25519 secret, salt=swarm key or "", info=both ids, both keys)``.
   It answers ``{peer, eph, ticket, lifetime_s, now, sig}``: its own id and X25519 key, the
   ticket (the caller's id and the session key sealed with AES-GCM under a key only this process
   knows, so the node keeps no per-session state), its clock, and its signature over all of it.
3. The caller checks that signature: it now knows which peer answered, and shares a key with it.

A replayed hello gets nothing: its session key needs the caller's X25519 private key. So a hello
needs no replay window; later requests do, and the caller stamps them with the node's clock (the
offset learnt in the handshake), so peers whose clocks disagree still talk.

Every later request carries the ticket and an HMAC-SHA256 under the session key over method,
path, the body's digest (for a stream: its header frame), timestamp and nonce; every answer an
HMAC bound to the request's nonce. Only the node the session was made with can check the MAC, so
a request cannot be replayed to another node, and the swarm key (the HKDF salt) is needed to
make a session at all. Ephemeral keys give forward secrecy; nothing here is stored on disk.

The hello may also ride on the first request to a node (``x-vp-hello``, see
:mod:`dht.net.client`), saving its round trip: then the caller's signature covers the hello and
that request too (the node it is meant for, method, path and the body's digest), its nonce and
timestamp are the request's (kept in the node's replay window like any request's), and the answer
carries the hello reply and is MACed under the new session key.

Wall-clock time is used for the timestamps on purpose: they must mean the same on two machines.
The node's side (answering hellos, opening tickets) is :mod:`dht.net.session_issuer`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import time
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dht.errors import AuthError, BadMessageError
from dht.identity import PeerIdentity, is_peer_id, public_key_problem, verify
from dht.net.wire import pack

PROTOCOL_VERSION = 2
HELLO_TAG = b"vp-hello/2"
HELLO_REPLY_TAG = b"vp-hello-reply/2"
FIRST_REQUEST_TAG = b"vp-first-request/2"
_SESSION_INFO = b"vp-session/2"
NONCE_BYTES = 16
KEY_BYTES = 32


def digest(data: bytes | memoryview) -> bytes:
    """SHA-256 of a body (or of a stream's header frame)."""
    return hashlib.sha256(data).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    # Each part length-prefixed, so no two part lists make the same message; one-shot HMAC.
    message = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    return hmac.digest(key, message, "sha256")


def x25519_raw(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def derive_key(
    shared: bytes, salt: bytes, caller: str, node: str, caller_eph: bytes, node_eph: bytes
) -> bytes:
    info = _SESSION_INFO + bytes.fromhex(caller) + bytes.fromhex(node) + caller_eph + node_eph
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt or None, info=info)
    return hkdf.derive(shared)


def hello_signed_bytes(peer: str, eph: bytes, ts: float, nonce: bytes) -> bytes:
    return pack([HELLO_TAG, peer, eph, ts, nonce])


@dataclass(frozen=True)
class FirstRequest:
    """What a hello that rides on a request signs on top of itself: that request.

    Attributes:
        to: the peer id of the node it is meant for (so no other node can replay it there).
        method, path: the request's, as the node sees them (a relayed node: the logical path).
        body_digest: SHA-256 of the body (of a stream's header frame).
    """

    to: str
    method: str
    path: str
    body_digest: bytes

    def signed_bytes(self, hello_peer: str, eph: bytes, ts: float, nonce: bytes) -> bytes:
        return pack(
            [FIRST_REQUEST_TAG, hello_peer, eph, ts, nonce, self.to, self.method, self.path,
             self.body_digest]
        )  # fmt: skip


def reply_signed_bytes(reply: HelloReply, caller_eph: bytes, nonce: bytes) -> bytes:
    return pack(
        [HELLO_REPLY_TAG, reply.peer, reply.eph, caller_eph, nonce, digest(reply.ticket),
         reply.lifetime_s, reply.now]
    )  # fmt: skip


@dataclass(frozen=True)
class HelloRequest:
    """A parsed, not yet verified ``/v2/hello`` body."""

    peer: str
    eph: bytes
    ts: float
    nonce: bytes
    sig: bytes

    @classmethod
    def parse(cls, obj: object) -> HelloRequest:
        """Check types and sizes; raises BadMessageError."""
        if not isinstance(obj, dict) or set(obj) != {"v", "peer", "eph", "ts", "nonce", "sig"}:
            raise BadMessageError("hello must be {v, peer, eph, ts, nonce, sig}")
        if obj["v"] != PROTOCOL_VERSION or isinstance(obj["v"], bool):
            raise BadMessageError(f"hello protocol version must be {PROTOCOL_VERSION}")
        hello = cls(obj["peer"], obj["eph"], obj["ts"], obj["nonce"], obj["sig"])
        if not is_peer_id(hello.peer):
            raise BadMessageError("hello names no valid peer id")
        _check_bytes(hello.eph, KEY_BYTES, "eph")
        _check_bytes(hello.nonce, NONCE_BYTES, "nonce")
        _check_bytes(hello.sig, 64, "sig")
        if not isinstance(hello.ts, float) or not math.isfinite(hello.ts):
            raise BadMessageError("hello ts must be a finite float")
        return hello

    def to_wire(self) -> dict:
        return {
            "v": PROTOCOL_VERSION,
            "peer": self.peer,
            "eph": self.eph,
            "ts": self.ts,
            "nonce": self.nonce,
            "sig": self.sig,
        }


@dataclass(frozen=True)
class HelloReply:
    """A parsed, not yet verified answer to ``/v2/hello``."""

    peer: str
    eph: bytes
    ticket: bytes
    lifetime_s: float
    now: float
    sig: bytes

    @classmethod
    def parse(cls, obj: object, max_ticket_bytes: int = 512) -> HelloReply:
        """Check types and sizes; raises BadMessageError."""
        fields = ("peer", "eph", "ticket", "lifetime_s", "now", "sig")
        if not isinstance(obj, dict) or set(obj) != set(fields):
            raise BadMessageError("hello reply must be {peer, eph, ticket, lifetime_s, now, sig}")
        reply = cls(*(obj[name] for name in fields))
        if not is_peer_id(reply.peer):
            raise BadMessageError("hello reply names no valid peer id")
        _check_bytes(reply.eph, KEY_BYTES, "eph")
        _check_bytes(reply.sig, 64, "sig")
        if not isinstance(reply.ticket, bytes) or not 0 < len(reply.ticket) <= max_ticket_bytes:
            raise BadMessageError("hello reply ticket must be bytes")
        lifetime = reply.lifetime_s
        if not isinstance(lifetime, float) or not 0 < lifetime <= 86400 * 7:
            raise BadMessageError("hello reply lifetime_s must be a float in (0, 1 week]")
        if not isinstance(reply.now, float) or not math.isfinite(reply.now):
            raise BadMessageError("hello reply now must be a finite float")
        return reply

    def to_wire(self) -> dict:
        return {
            "peer": self.peer,
            "eph": self.eph,
            "ticket": self.ticket,
            "lifetime_s": self.lifetime_s,
            "now": self.now,
            "sig": self.sig,
        }


def _check_bytes(value: object, length: int, name: str) -> None:
    if not isinstance(value, bytes) or len(value) != length:
        raise BadMessageError(f"{name} must be {length} bytes")


@dataclass(frozen=True)
class Session:
    """The caller's side of a session with one node.

    Attributes:
        peer_id: the node's proven peer id.
        key: the session key (32 bytes).
        ticket: the opaque ticket to present, as it travels in ``x-vp-ticket``.
        renew_at_s: when (``time.monotonic``) to make a new session before this one expires.
        clock_offset_s: the node's wall clock minus this one's, in seconds (requests are
            stamped with the node's time).
    """

    peer_id: str
    key: bytes
    ticket: str
    renew_at_s: float
    clock_offset_s: float = 0.0


class PendingHello:
    """A caller's hello in flight: the ephemeral key stays here until the reply arrives."""

    def __init__(
        self,
        identity: PeerIdentity,
        first: FirstRequest | None = None,
        clock_offset_s: float = 0.0,
    ):
        """Sign a hello; with ``first``, one that rides on that request and signs it too (its
        timestamp must then be within the node's replay window: ``clock_offset_s``, the
        swarm's clock minus this one as other nodes told it, is added to it)."""
        self._identity = identity
        self._eph = X25519PrivateKey.generate()
        eph_raw = x25519_raw(self._eph)
        self._sent_s = time.time()
        ts = round(self._sent_s + clock_offset_s, 3)
        nonce = os.urandom(NONCE_BYTES)
        if first is None:
            signed = hello_signed_bytes(identity.peer_id, eph_raw, ts, nonce)
        else:
            signed = first.signed_bytes(identity.peer_id, eph_raw, ts, nonce)
        sig = identity.sign(signed)
        self.request = HelloRequest(identity.peer_id, eph_raw, ts, nonce, sig)

    @property
    def nonce_hex(self) -> str:
        """The nonce as a request's ``x-vp-nonce`` (the answer to a first request is MACed
        under it)."""
        return self.request.nonce.hex()

    def finish(self, reply_obj: object, *, swarm_key: bytes | None) -> Session:
        """Check the node's reply and derive the session.

        Raises:
            BadMessageError: the reply is malformed.
            AuthError: its signature does not verify.
        """
        reply = HelloReply.parse(reply_obj)
        problem = public_key_problem(reply.peer)
        if problem is not None:
            raise AuthError(f"hello reply's peer id is not a usable Ed25519 key: {problem}")
        signed = reply_signed_bytes(reply, self.request.eph, self.request.nonce)
        if not verify(reply.peer, signed, reply.sig):
            raise AuthError("hello reply signature does not verify")
        try:
            shared = self._eph.exchange(X25519PublicKey.from_public_bytes(reply.eph))
        except ValueError as e:  # a low-order point: no shared secret
            raise AuthError(f"hello reply key unusable: {e}") from None
        key = derive_key(
            shared, swarm_key or b"", self._identity.peer_id, reply.peer, self.request.eph,
            reply.eph,
        )  # fmt: skip
        # Renew at 80% of the lifetime: a request never meets a ticket expiring on its way.
        renew_at_s = time.monotonic() + 0.8 * reply.lifetime_s
        ticket = base64.urlsafe_b64encode(reply.ticket).decode()
        # The node read its clock about half way between our hello and its reply.
        offset_s = reply.now - (self._sent_s + time.time()) / 2
        return Session(reply.peer, key, ticket, renew_at_s, offset_s)


def request_mac(key: bytes, method: str, path: str, body_digest: bytes, ts: str, nonce: str) -> str:
    """The MAC of one request under a session key (hex)."""
    parts = (b"request", method.encode(), path.encode(), body_digest, ts.encode(), nonce.encode())
    return _mac(key, *parts).hex()


def response_mac(key: bytes, nonce: str, status: int, body_digest: bytes) -> str:
    """The MAC of the answer to the request with ``nonce`` (hex)."""
    return _mac(key, b"response", nonce.encode(), str(status).encode(), body_digest).hex()


def macs_equal(expected_hex: str, given_hex: str) -> bool:
    return hmac.compare_digest(expected_hex.encode(), given_hex.encode("ascii", "replace"))


def new_nonce() -> str:
    """A request nonce: 16 random bytes as 32 hex characters."""
    return os.urandom(NONCE_BYTES).hex()
