"""The relayed peer's side: a tunnel to a relay, kept open, that serves what arrives through it.

A peer that others cannot reach keeps its own server (every handler, check and limit unchanged)
on a local port and keeps one WebSocket open to a relay (``GET /v2/relay-attach``, signed like any
request after the handshake, so the relay learns the proven peer id). Each request forwarded
through the tunnel becomes a local HTTP request to that server, its body and its answer streamed
both ways at once. The peer is then reached at ``{relay URL}/v2/relay/{peer id}``. When the
tunnel closes (the relay died, or no heartbeat answer within 1.5 times ``relay_heartbeat_s``),
the peer attaches to another candidate relay, and the listeners hear the new address.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiohttp

from dht.errors import (
    BadMessageError,
    DHTError,
    RemoteError,
    RequestTimeoutError,
    TransportError,
)
from dht.net.client import RENEW_HEADER, TUNNEL_HEADER, ClientSessions, signed_headers
from dht.net.config import TransportConfig
from dht.net.schema import parse_address
from dht.net.session import digest
from dht.reach.relay_mux import HEAD, MAX_MESSAGE_BYTES, Mux, MuxStream
from dht.reach.relay_server import ATTACH_PATH, FORWARDED_PATH, RELAY_PREFIX, forwarded_headers

logger = logging.getLogger(__name__)

Candidates = Sequence[str] | Callable[[], Sequence[str]]
AddressListener = Callable[[str], None]


def relayed_address(relay_url: str, peer_id: str) -> str:
    """The address of ``peer_id`` through the relay at ``relay_url``."""
    return f"{relay_url}{RELAY_PREFIX}{peer_id}"


class RelayTunnel:
    """Keeps this node attached to one relay of ``candidates``; serves requests from it.

    Args:
        http: the transport's client session.
        sessions: the transport's sessions (an attach is a signed request to the relay).
        peer_id: this node's peer id.
        local_url: this node's own server, as this process reaches it (``http://127.0.0.1:P``).
        tunnel_token: the mark of this tunnel's local requests (the server's ``tunnel_token``).
        config: ``relay_*`` timeouts, ``stream_*`` timeouts, ``max_relayed_requests_per_peer``.
        candidates: relay URLs, or a function returning them (asked again at every re-attach).
    """

    def __init__(
        self,
        *,
        http: aiohttp.ClientSession,
        sessions: ClientSessions,
        peer_id: str,
        local_url: str,
        tunnel_token: str,
        config: TransportConfig,
        candidates: Candidates,
    ):
        self._http = http
        self._sessions = sessions
        self._peer_id = peer_id
        self._local_url = local_url
        self._tunnel_token = tunnel_token
        self._config = config
        self._candidates = candidates
        self._listeners: list[AddressListener] = []
        self._mux: Mux | None = None
        self._task: asyncio.Task | None = None
        self.relay_url: str | None = None
        self.address: str | None = None
        self.num_attaches = 0

    def add_listener(self, listener: AddressListener) -> None:
        """Call ``listener(new_address)`` each time this node moves to another relay."""
        self._listeners.append(listener)

    async def start(self) -> str:
        """Attach to the first candidate that accepts, then keep attached; the relayed address.

        Raises:
            TransportError: no candidate accepted (the message says why for each).
        """
        await self._attach_any(avoid=None)
        self._task = asyncio.create_task(self._keep_attached())
        return self.address

    async def close(self) -> None:
        """Detach and stop; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._mux is not None:
            await self._mux.close("relayed peer shutting down")

    async def _keep_attached(self) -> None:
        while True:
            await self._mux.run()
            lost = self.relay_url
            logger.warning(
                "relay %s lost (%s); attaching to another candidate", lost, self._mux.close_reason
            )
            level = logging.WARNING  # the first failure to re-attach is news, the next ones not
            while True:
                try:
                    await self._attach_any(avoid=lost)
                    break
                except (DHTError, aiohttp.ClientError, OSError) as e:
                    logger.log(level, "%s; trying again every %s s", e, self._config.relay_retry_s)
                    level = logging.DEBUG
                    await asyncio.sleep(self._config.relay_retry_s)
            logger.warning("reached through relay %s now, at %s", self.relay_url, self.address)
            for listener in self._listeners:
                try:
                    listener(self.address)
                except Exception:  # an owner's bug must not end the tunnel's upkeep
                    logger.exception("address listener %r failed", listener)

    def _ordered_candidates(self, avoid: str | None) -> list[str]:
        found = self._candidates() if callable(self._candidates) else self._candidates
        usable = []
        for url in found:
            try:
                url = parse_address(url)
            except BadMessageError:
                continue  # a relayed address (or junk) cannot relay
            if RELAY_PREFIX not in url and url != self._local_url and url not in usable:
                usable.append(url)
        # the relay just lost goes last: another one is more likely alive
        return sorted(usable, key=lambda url: url == avoid)

    async def _attach_any(self, avoid: str | None) -> None:
        failures = []
        for url in self._ordered_candidates(avoid):
            try:
                await self._attach(url, may_renew=True)
                return
            except TransportError as e:
                failures.append(f"{url}: {e}")
        raise TransportError("no relay accepted this peer: " + ("; ".join(failures) or "none"))

    async def _attach(self, url: str, *, may_renew: bool) -> None:
        cfg = self._config
        session = await self._sessions.get(
            self._http, url, timeout_s=cfg.relay_attach_timeout_s, expected=None
        )
        headers = signed_headers(session, self._peer_id, "GET", ATTACH_PATH, digest(b""))
        try:
            async with asyncio.timeout(cfg.relay_attach_timeout_s):
                ws = await self._http.ws_connect(
                    url + ATTACH_PATH,
                    headers=headers,
                    heartbeat=cfg.relay_heartbeat_s,
                    max_msg_size=MAX_MESSAGE_BYTES,
                )
        except aiohttp.WSServerHandshakeError as e:
            answer = e.headers or {}
            if e.status == 401 and answer.get(RENEW_HEADER) == "renew" and may_renew:
                self._sessions.forget(url, session)
                return await self._attach(url, may_renew=False)
            raise RemoteError(e.status, answer.get("x-vp-error") or e.message) from None
        except TimeoutError:
            raise RequestTimeoutError(
                f"attach took longer than {cfg.relay_attach_timeout_s} s"
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise TransportError(f"attach failed: {e}") from e
        self._mux = Mux(
            ws,
            idle_timeout_s=cfg.stream_idle_timeout_s,
            write_timeout_s=cfg.stream_write_timeout_s,
            max_streams=cfg.max_relayed_requests_per_peer,
            on_open=self._serve,
        )
        self.relay_url = url
        self.address = relayed_address(url, self._peer_id)
        self.num_attaches += 1

    # ---- serving what the relay forwards -----------------------------------------------------

    async def _serve(self, stream: MuxStream) -> None:
        cfg = self._config
        try:
            method, path, headers = _opening(await stream.read_message())
            if method == "GET" and await stream.read() is not None:
                raise BadMessageError("a GET with a body")
            headers[TUNNEL_HEADER] = self._tunnel_token
            body = _body(stream) if method == "POST" else None
            url = self._local_url + path
            # The own server answers a body that never comes with 408 after its
            # request_timeout_s: waiting half of that again lets its answer (a reason the
            # caller can read) win the race against this wait on a loaded machine.
            forward_timeout_s = max(1.5 * cfg.request_timeout_s, cfg.stream_idle_timeout_s)
            try:
                async with asyncio.timeout(forward_timeout_s):
                    # expect100: the headers go out at once (aiohttp would hold them back until
                    # the body's first byte), so the server refuses or times out a body that
                    # never comes itself, and answers
                    response = await self._http.request(
                        method, url, data=body, headers=headers, ssl=False,
                        expect100=body is not None,
                    )  # fmt: skip
            except TimeoutError:
                raise RequestTimeoutError(
                    f"its own server did not answer within {forward_timeout_s} s"
                ) from None
            async with response:
                head = {"s": response.status, "h": forwarded_headers(response.headers)}
                await stream.write_message(HEAD, head)
                async for chunk in response.content.iter_any():
                    await stream.write(chunk)
                await stream.end()
        except (DHTError, aiohttp.ClientError, OSError, TimeoutError) as e:
            await stream.reset(f"relayed peer could not serve it: {e}")
        finally:
            await stream.close("relayed request ended")


async def _body(stream: MuxStream):
    while (chunk := await stream.read()) is not None:
        yield chunk


def _opening(message: dict) -> tuple[str, str, dict[str, str]]:
    method, path, headers = message.get("m"), message.get("p"), message.get("h")
    if method not in ("GET", "POST"):
        raise BadMessageError(f"relayed method {method!r} is not GET or POST")
    if not isinstance(path, str) or not FORWARDED_PATH.fullmatch(path):
        raise BadMessageError("relayed path is not a /v2/ request path")
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise BadMessageError("relayed headers are not a map of strings")
    return method, path, forwarded_headers(headers)
