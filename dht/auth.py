"""Swarm access control: an HMAC over every request and response under a shared swarm key.

A request carries ``x-vp-peer`` (sender id), ``x-vp-ts`` (unix seconds), ``x-vp-nonce`` and
``x-vp-mac`` = HMAC-SHA256(key, method, path, sha256(body), sender, ts, nonce). A receiver refuses
a MAC that is wrong, a timestamp outside the replay window, and a nonce it saw within the window.
Responses carry a MAC bound to the request's nonce, so a reply cannot be forged or moved to
another request. Stream frames carry a 16-byte tag bound to the nonce, the direction and the frame
number, so frames cannot be altered, dropped, reordered or spliced between streams.

Wall-clock time is used here on purpose: the timestamp must mean the same on two machines.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict

from dht.errors import AuthError

FRAME_TAG_BYTES = 16


def body_digest(body: bytes | memoryview) -> bytes:
    return hashlib.sha256(body).digest()


class SwarmAuth:
    """Signs and checks requests, responses and stream frames with one swarm key.

    Args:
        key: the shared swarm key (at least 16 bytes).
        replay_window_s: how far a request timestamp may be from this node's clock, in seconds;
            nonces are remembered for this long.
    """

    def __init__(self, key: bytes, *, replay_window_s: float = 30.0):
        if len(key) < 16:
            raise AuthError("swarm key must be at least 16 bytes")
        self._key = key
        self.replay_window_s = replay_window_s
        self._seen_nonces: OrderedDict[bytes, float] = OrderedDict()

    def _mac(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(4, "little"))
            mac.update(part)
        return mac.digest()

    def sign_request(self, method: str, path: str, digest: bytes, sender: str) -> dict[str, str]:
        """Headers that authenticate one request whose body has sha256 ``digest``."""
        ts = f"{time.time():.3f}"
        nonce = os.urandom(16).hex()
        mac = self._mac(
            method.encode(), path.encode(), digest, sender.encode(), ts.encode(), nonce.encode()
        )
        return {"x-vp-ts": ts, "x-vp-nonce": nonce, "x-vp-mac": mac.hex()}

    def check_request(self, method: str, path: str, digest: bytes, headers) -> None:
        """Raise :class:`AuthError` unless the request's MAC, timestamp and nonce are good."""
        sender, ts, nonce, mac_hex = (
            headers.get(h, "") for h in ("x-vp-peer", "x-vp-ts", "x-vp-nonce", "x-vp-mac")
        )
        if not mac_hex:
            raise AuthError("missing swarm MAC")
        expected = self._mac(
            method.encode(), path.encode(), digest, sender.encode(), ts.encode(), nonce.encode()
        )
        try:
            given = bytes.fromhex(mac_hex)
        except ValueError:
            raise AuthError("malformed swarm MAC") from None
        if not hmac.compare_digest(expected, given):
            raise AuthError("wrong swarm MAC")
        try:
            age_s = abs(time.time() - float(ts))
        except ValueError:
            raise AuthError("malformed timestamp") from None
        if age_s > self.replay_window_s:
            raise AuthError(f"stale request: timestamp {age_s:.0f} s away from now")
        self._remember_nonce(nonce.encode())

    def _remember_nonce(self, nonce: bytes) -> None:
        now = time.monotonic()
        while self._seen_nonces:
            oldest, seen_at = next(iter(self._seen_nonces.items()))
            if now - seen_at <= 2 * self.replay_window_s:
                break
            del self._seen_nonces[oldest]
        if nonce in self._seen_nonces:
            raise AuthError("replayed request (nonce seen before)")
        self._seen_nonces[nonce] = now

    def sign_response(self, nonce: str, status: int, digest: bytes) -> str:
        return self._mac(b"response", nonce.encode(), str(status).encode(), digest).hex()

    def check_response(self, nonce: str, status: int, digest: bytes, mac_hex: str) -> None:
        expected = self.sign_response(nonce, status, digest)
        if not hmac.compare_digest(expected, mac_hex):
            raise AuthError("response MAC missing or wrong")

    def frame_tag(self, nonce: str, direction: bytes, seq: int, header: bytes, payload) -> bytes:
        """The tag of frame ``seq`` of a stream (``direction`` is b"up" or b"down")."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(nonce.encode() + direction + seq.to_bytes(8, "little") + header)
        mac.update(payload)
        return mac.digest()[:FRAME_TAG_BYTES]

    def check_frame_tag(self, expected: bytes, given: bytes) -> None:
        if not hmac.compare_digest(expected, given):
            raise AuthError("stream frame MAC wrong")
