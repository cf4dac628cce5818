"""The caller's side of proven identity: one session per node address, and signed requests.

The first RPC to a node whose peer id the caller knows carries its hello (``x-vp-hello``: the
hello, signed together with the request, see :mod:`dht.net.session`), and the answer carries the
hello reply (``x-vp-hello-reply``): the session costs no extra round trip. A node that refuses
that (a timestamp outside its replay window, another peer at the address) answers 401 with
``x-vp-session: renew``, and the caller falls back to the separate handshake
(``POST /v2/hello``), as it does for streams and for nodes known only by address; concurrent
separate handshakes with one address share one. Sessions are renewed before they expire, and
made again at once when the node says it no longer knows them (it restarted).
"""

from __future__ import annotations

import asyncio
import base64
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
from dht.net.session import (
    FirstRequest,
    PendingHello,
    Session,
    digest,
    new_nonce,
    request_mac,
    response_mac,
)
from dht.net.wire import MessageLimits, pack, unpack

API_VERSION = "v2"
HELLO_PATH = f"/{API_VERSION}/hello"
MAX_HELLO_BYTES = 1024  # a hello and its reply are a few hundred bytes
# A hello riding on a request, and the reply riding on its answer: base64url(msgpack), in headers
# so that the node checks the hello before it reads the body.
HELLO_HEADER = "x-vp-hello"
HELLO_REPLY_HEADER = "x-vp-hello-reply"
MAX_HELLO_HEADER_CHARS = 4 * MAX_HELLO_BYTES // 3 + 4
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


def encode_hello_header(obj: dict) -> str:
    return base64.urlsafe_b64encode(pack(obj)).decode("ascii")


def decode_hello_header(value: str, limits: MessageLimits) -> object:
    """The msgpack object of an ``x-vp-hello`` (or reply) header; raises BadMessageError."""
    if len(value) > MAX_HELLO_HEADER_CHARS:
        raise BadMessageError(f"hello header over {MAX_HELLO_HEADER_CHARS} characters")
    try:
        raw = base64.urlsafe_b64decode(value.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise BadMessageError("hello header is not base64url") from None
    return unpack(raw, limits)


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
        self._clock_offset_s = 0.0
        self.num_handshakes = 0  # separate handshakes (each a round trip of its own)
        self.num_first_hellos = 0  # hellos sent on a first request

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
        return self._keep(address, session)

    def _keep(self, address: str, session: Session) -> Session:
        # A first request's hello is stamped with the clock the nodes told us last: a caller
        # whose own clock is off learns that from its first handshake and then stays within
        # the nodes' replay windows.
        self._clock_offset_s = session.clock_offset_s
        self._sessions[address] = session
        self._sessions.move_to_end(address)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return session

    # ---- RPCs: one request, one answer, the first one carrying its hello ---------------------

    def _current(self, address: str, expected: str | None) -> Session | None:
        session = self._sessions.get(address)
        if session is None or time.monotonic() >= session.renew_at_s:
            return None
        if expected is not None and session.peer_id != expected:
            return None
        self._sessions.move_to_end(address)
        return session

    async def post(
        self,
        http: aiohttp.ClientSession,
        address: str,
        path: str,
        body: bytes,
        *,
        expected: str | None,
        handshake_timeout_s: float,
        max_answer_bytes: int,
    ) -> tuple[Session, bytes]:
        """POST ``body`` to ``address + path`` as a proven request; the session it was proven
        under and the answer's body (its MAC checked).

        With no current session, a node whose id is ``expected`` gets the hello on this request
        (no separate handshake unless it asks for one); otherwise a handshake comes first.

        Raises:
            WrongPeerError: ``expected`` is given and another peer proved itself there.
            RemoteError: the node refused (a 4xx/5xx and its reason).
            TransportError: the request or its answer failed (or the answer is not proven).
            RequestTimeoutError: the handshake did not complete within its timeout.
        """
        body_digest = digest(body)
        session = self._current(address, expected)
        if session is None and expected is not None and address not in self._pending:
            first = FirstRequest(expected, "POST", path, body_digest)
            done = await self._post_with_hello(http, address, path, body, first, max_answer_bytes)
            if done is not None:
                return done
            session = None  # the node asked for a separate handshake
        for may_renew in (True, False):
            if session is None:
                session = await self.get(
                    http, address, timeout_s=handshake_timeout_s, expected=expected
                )
            headers = signed_headers(session, self._identity.peer_id, "POST", path, body_digest)
            headers["content-type"] = MSGPACK
            resp, data = await _post(http, address + path, body, headers, max_answer_bytes)
            if not (may_renew and needs_new_session(resp)):
                break
            self.forget(address, session)
            session = None
        _raise_unless_ok(resp)
        check_proven(session, headers["x-vp-nonce"], data, resp.headers)
        return session, data

    async def _post_with_hello(
        self,
        http: aiohttp.ClientSession,
        address: str,
        path: str,
        body: bytes,
        first: FirstRequest,
        max_answer_bytes: int,
    ) -> tuple[Session, bytes] | None:
        """The request with its hello; None if the node asks for a separate handshake."""
        hello = PendingHello(self._identity, first, self._clock_offset_s)
        wire = encode_hello_header(hello.request.to_wire())
        headers = {
            "content-type": MSGPACK,
            "x-vp-peer": self._identity.peer_id,
            "x-vp-digest": first.body_digest.hex(),
            HELLO_HEADER: wire,
        }
        if self._swarm is not None:
            headers["x-vp-mac"] = self._swarm.hello_mac(wire.encode("ascii"))
        self.num_first_hellos += 1
        resp, data = await _post(http, address + path, body, headers, max_answer_bytes)
        if needs_new_session(resp):
            return None
        _raise_unless_ok(resp)
        try:
            reply = decode_hello_header(resp.headers.get(HELLO_REPLY_HEADER, ""), self._limits)
            session = hello.finish(reply, swarm_key=self._swarm_key)
        except (BadMessageError, AuthError) as e:
            raise TransportError(f"first request to {address}: its hello failed: {e}") from e
        if session.peer_id != first.to:  # it answered though it was not the one meant
            raise WrongPeerError(address, first.to, session.peer_id)
        check_proven(session, hello.nonce_hex, data, resp.headers)
        return self._keep(address, session), data


def check_proven(session: Session, nonce: str, data: bytes, headers) -> None:
    """Raise TransportError unless a 200 answer is MACed under ``session``."""
    try:
        check_response(session, nonce, 200, data, headers)
    except AuthError as e:
        raise TransportError(f"answer from {session.peer_id[:8]}: {e}") from e


def _raise_unless_ok(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        raise RemoteError(resp.status, resp.headers.get("x-vp-error") or resp.reason or "")


async def _post(
    http: aiohttp.ClientSession, url: str, body: bytes, headers: dict, max_bytes: int
) -> tuple[aiohttp.ClientResponse, bytes]:
    try:
        async with http.post(url, data=body, headers=headers) as resp:
            return resp, await read_limited(resp, max_bytes)
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise TransportError(f"POST {url} failed: {e}") from e


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
