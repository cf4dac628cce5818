"""The node's side of proven identity: it answers hellos and opens the tickets of later
requests (the protocol is in :mod:`dht.net.session`)."""

from __future__ import annotations

import base64
import dataclasses
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dht.errors import AuthError
from dht.identity import PeerIdentity, public_key_problem, verify
from dht.net.session import (
    KEY_BYTES,
    FirstRequest,
    HelloReply,
    HelloRequest,
    derive_key,
    hello_signed_bytes,
    reply_signed_bytes,
    x25519_raw,
)

_TICKET_AAD = b"vp-ticket/2"
_GCM_NONCE_BYTES = 12
_MAX_OPENED_TICKETS = 4096
MAX_HELLO_SKEW_S = 86400.0


@dataclass(frozen=True)
class ProvenCaller:
    """What a node learns from a valid ticket: who the caller is and the key it shares."""

    peer_id: str
    key: bytes


class SessionIssuer:
    """The node's side: answers hellos and opens the tickets of later requests.

    Args:
        identity: this node's key pair (signs hello replies).
        swarm_key: the swarm key, or None; mixed into every session key.
        lifetime_s: how long a ticket is good for, in seconds.
        max_hello_skew_s: how far a hello's timestamp may be from this node's clock, in seconds
            (a sanity bound: a replayed hello gets nothing, see the module's docstring).
    """

    def __init__(
        self,
        identity: PeerIdentity,
        *,
        swarm_key: bytes | None,
        lifetime_s: float,
        max_hello_skew_s: float = MAX_HELLO_SKEW_S,
    ):
        self._identity = identity
        self._swarm_key = swarm_key or b""
        self.lifetime_s = lifetime_s
        self.max_hello_skew_s = max_hello_skew_s
        self._sealer = AESGCM(AESGCM.generate_key(bit_length=256))
        # Tickets opened lately: a caller presents the same one on every request.
        self._opened: OrderedDict[str, tuple[ProvenCaller, float]] = OrderedDict()

    def check_hello(
        self, hello: HelloRequest, now_s: float | None = None, first: FirstRequest | None = None
    ) -> None:
        """Raise AuthError unless the hello is fresh and signed by the peer it names (with
        ``first``: signed together with that request; its ``to`` is this node's id, so a hello
        meant for another node does not verify)."""
        now_s = time.time() if now_s is None else now_s
        if abs(now_s - hello.ts) > self.max_hello_skew_s:
            raise AuthError(f"stale hello: timestamp {abs(now_s - hello.ts):.0f} s from now")
        problem = public_key_problem(hello.peer)
        if problem is not None:  # checked before the signature: under some, any one verifies
            raise AuthError(f"hello's peer id is not a usable Ed25519 key: {problem}")
        if first is None:
            signed = hello_signed_bytes(hello.peer, hello.eph, hello.ts, hello.nonce)
        else:
            signed = first.signed_bytes(hello.peer, hello.eph, hello.ts, hello.nonce)
        if not verify(hello.peer, signed, hello.sig):
            raise AuthError("hello signature does not verify")

    def answer(self, hello: HelloRequest) -> HelloReply:
        """A session for a checked hello: the reply to send back."""
        return self.answer_with_key(hello)[0]

    def answer_with_key(self, hello: HelloRequest) -> tuple[HelloReply, bytes]:
        """A session for a checked hello: the reply to send back and the session key (to MAC
        the answer of a request the hello rode on)."""
        eph = X25519PrivateKey.generate()
        eph_raw = x25519_raw(eph)
        try:
            shared = eph.exchange(X25519PublicKey.from_public_bytes(hello.eph))
        except ValueError as e:
            raise AuthError(f"hello key unusable: {e}") from None
        me = self._identity.peer_id
        key = derive_key(shared, self._swarm_key, hello.peer, me, hello.eph, eph_raw)
        expires_s = time.monotonic() + self.lifetime_s
        plain = bytes.fromhex(hello.peer) + key + int(expires_s * 1000).to_bytes(8, "little")
        gcm_nonce = os.urandom(_GCM_NONCE_BYTES)
        ticket = gcm_nonce + self._sealer.encrypt(gcm_nonce, plain, _TICKET_AAD)
        reply = HelloReply(me, eph_raw, ticket, float(self.lifetime_s), time.time(), b"")
        signed = reply_signed_bytes(reply, hello.eph, hello.nonce)
        return dataclasses.replace(reply, sig=self._identity.sign(signed)), key

    def open_ticket(self, ticket: str) -> ProvenCaller:
        """The caller a ticket was issued to.

        Raises:
            AuthError: the ticket is malformed, was not issued by this process, or expired.
        """
        opened = self._opened.get(ticket)
        if opened is None:
            opened = self._open(ticket)
            self._opened[ticket] = opened
            if len(self._opened) > _MAX_OPENED_TICKETS:
                self._opened.popitem(last=False)
        caller, expires_s = opened
        if time.monotonic() > expires_s:
            raise AuthError("unknown session: ticket expired")
        return caller

    def _open(self, ticket: str) -> tuple[ProvenCaller, float]:
        try:
            raw = base64.urlsafe_b64decode(ticket.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            raise AuthError("unknown session: malformed ticket") from None
        try:
            plain = self._sealer.decrypt(
                raw[:_GCM_NONCE_BYTES], raw[_GCM_NONCE_BYTES:], _TICKET_AAD
            )
        except (InvalidTag, ValueError):
            raise AuthError("unknown session: ticket not issued by this node") from None
        if len(plain) != 32 + KEY_BYTES + 8:
            raise AuthError("unknown session: malformed ticket")
        expires_s = int.from_bytes(plain[-8:], "little") / 1000
        return ProvenCaller(plain[:32].hex(), plain[32 : 32 + KEY_BYTES]), expires_s
