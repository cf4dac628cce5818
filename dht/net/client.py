"""The caller's side of proven identity: one session per node address, and signed requests.

The first request to an address makes a session (``POST /v2/hello``, see :mod:`dht.net.session`);
concurrent first requests share that one handshake. Sessions are renewed before they expire, and
made again at once when the node says it no longer knows them (it restarted).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import aiohttp

from dht.errors import (
    AuthError,
    BadMessageError,
    RemoteError,
    RequestTimeoutError,
    TransportError,
    WrongPeerError,
)
from dht.identity import PeerIdentity
from dht.net.auth import SwarmAuth
from dht.net.session import PendingHello, Session, digest, new_nonce, request_mac, response_mac
from dht.net.wire import MessageLimits, pack, unpack

API_VERSION = "v2"
HELLO_PATH = f"/{API_VERSION}/hello"
MAX_HELLO_BYTES = 1024  # a hello and its reply are a few hundred bytes
MSGPACK = "application/msgpack"
# Set on a 401 whose cause is the session (unknown to the node, expired): make a new one.
RENEW_HEADER = "x-vp-session"
# On the local requests of a relayed node's tunnel (dht.reach.relay_client); never forwarded by a
# relay.
TUNNEL_HEADER = "x-vp-tunnel"


def signed_headers(
    session: Session, own_peer_id: str, method: str, path: str, body_digest: bytes
) -> dict[str, str]:
    """The headers that prove one request under ``session``."""
    ts = f"{time.time() + session.clock_offset_s:.3f}"  # the node's clock, not ours
    nonce = new_nonce()
    return {
        "x-vp-peer": own_peer_id,
        "x-vp-ticket": session.ticket,
        "x-vp-ts": ts,
        "x-vp-nonce": nonce,
        "x-vp-digest": body_digest.hex(),
        "x-vp-mac": request_mac(session.key, method, path, body_digest, ts, nonce),
    }


def check_response(session: Session, nonce: str, status: int, body: bytes, headers) -> None:
    """Raise :class:`AuthError` unless the answer was made by the session's node."""
    expected = response_mac(session.key, nonce, status, digest(body))
    if headers.get("x-vp-mac", "") != expected:
        raise AuthError(f"answer not signed by {session.peer_id[:8]} (MAC missing or wrong)")


def needs_new_session(resp: aiohttp.ClientResponse) -> bool:
    return resp.status == 401 and resp.headers.get(RENEW_HEADER) == "renew"


class ClientSessions:
    """Sessions with the nodes this transport calls, by address.

    Args:
        identity: this node's key pair (signs hellos).
        swarm_key: the swarm key or None.
        limits: bounds on decoding hello replies.
        max_sessions: the most sessions kept (least recently used forgotten first).
    """

    def __init__(
        self,
        identity: PeerIdentity,
        *,
        swarm_key: bytes | None,
        limits: MessageLimits,
        max_sessions: int = 4096,
    ):
        self._identity = identity
        self._swarm_key = swarm_key
        self._swarm = SwarmAuth(swarm_key) if swarm_key else None
        self._limits = limits
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Session]] = {}
        self.num_handshakes = 0

    def peer_at(self, address: str) -> str | None:
        """The proven peer id of the node at ``address``, if a session with it is current."""
        session = self._sessions.get(address)
        return session.peer_id if session is not None else None

    def forget(self, address: str, session: Session) -> None:
        """Drop ``session`` (the node no longer knows it); the next request makes a new one."""
        if self._sessions.get(address) is session:
            del self._sessions[address]

    async def get(
        self, http: aiohttp.ClientSession, address: str, *, timeout_s: float, expected: str | None
    ) -> Session:
        """A current session with ``address``, made if needed (within ``timeout_s``).

        Raises:
            WrongPeerError: ``expected`` is given and another peer proved itself there.
            RequestTimeoutError, RemoteError, TransportError: the handshake failed.
        """
        session = self._sessions.get(address)
        if session is not None and expected is not None and session.peer_id != expected:
            session = None  # another peer may serve there by now: ask the address again
        if session is None or time.monotonic() >= session.renew_at_s:
            pending = self._pending.get(address)
            if pending is None:
                pending = asyncio.ensure_future(self._hello(http, address, timeout_s))
                self._pending[address] = pending
                pending.add_done_callback(lambda done: self._settled(address, done))
            # shield: a caller that gives up must not cancel the handshake others wait for
            session = await asyncio.shield(pending)
        else:
            self._sessions.move_to_end(address)
        if expected is not None and session.peer_id != expected:
            raise WrongPeerError(address, expected, session.peer_id)
        return session

    def _settled(self, address: str, done: asyncio.Future) -> None:
        self._pending.pop(address, None)
        if not done.cancelled():
            done.exception()  # retrieved here: every waiter may have given up

    async def close(self) -> None:
        """Cancel handshakes in flight; safe to call twice."""
        pending = list(self._pending.values())
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _hello(self, http: aiohttp.ClientSession, address: str, timeout_s: float) -> Session:
        hello = PendingHello(self._identity)
        body = pack(hello.request.to_wire())
        headers = {"content-type": MSGPACK}
        if self._swarm is not None:
            headers["x-vp-mac"] = self._swarm.hello_mac(body)
        self.num_handshakes += 1
        try:
            async with asyncio.timeout(timeout_s):
                async with http.post(address + HELLO_PATH, data=body, headers=headers) as resp:
                    data = await read_limited(resp, MAX_HELLO_BYTES)
        except TimeoutError:
            raise RequestTimeoutError(
                f"no handshake answer from {address} in time ({timeout_s} s)"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError, BadMessageError) as e:
            raise TransportError(f"handshake with {address} failed: {e}") from e
        if resp.status != 200:
            raise RemoteError(resp.status, resp.headers.get("x-vp-error") or resp.reason or "")
        try:
            session = hello.finish(unpack(data, self._limits), swarm_key=self._swarm_key)
        except (BadMessageError, AuthError) as e:
            raise TransportError(f"handshake with {address} failed: {e}") from e
        self._sessions[address] = session
        self._sessions.move_to_end(address)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return session


async def read_limited(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The response body, refused (BadMessageError) beyond ``max_bytes``."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise BadMessageError(f"response of {resp.content_length} bytes exceeds {max_bytes}")
    data = await resp.content.read(max_bytes + 1)
    while len(data) <= max_bytes and not resp.content.at_eof():
        more = await resp.content.read(max_bytes + 1 - len(data))
        if not more:
            break
        data += more
    if len(data) > max_bytes:
        raise BadMessageError(f"response exceeds {max_bytes} bytes")
    return data
