"""The relay's side: peers that others cannot reach attach here, and requests reach them through it.

``GET /v2/relay-attach`` is authenticated like any request after the handshake (the session's
headers, :meth:`dht.net.server.HttpServer.authenticate`) and upgrades to a WebSocket: the tunnel
(:mod:`dht.reach.relay_mux`) of the proven peer id, so a peer can attach only under its own id (a
new attach under that id replaces the old tunnel). A request to ``/v2/relay/{peer_id}/{path}`` is
forwarded through that tunnel as it arrives, its answer streamed back, both ways at once; the relay
forwards the caller's ``x-vp-*`` headers and bytes unchanged and holds no session key with either
end, so it can read and forge nothing: the caller and the relayed peer check each other's MACs end
to end (``path`` is the logical ``/v2/...`` path both sign).

Shares: a forwarded request is one of its caller address's requests at the relay
(``max_requests_per_s_per_address``, 429 past it), its bytes are paid into that address's byte
bucket, and it holds one of the address's request slots of that peer (past them, a 429 that
empties the address's bucket of requests). A relayed peer's slots and the relay's seats are
shared fairly when full (:class:`dht.net.shares.FairSlots`): an address holding fewer than its
fair share takes the oldest slot (seat) of an address over its own, whose request is reset and
answered 429 (whose tunnel is closed). The relay adds the
caller's address (``x-vp-relayed-for``: its IPv4 address or IPv6 /64, replacing any the caller
sent), which the relayed peer charges its address shares to as ``relayed/{address}`` (a hint:
a relay that lies only moves its own callers' requests between its own keys; every request is
also charged to its proven peer id there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re

from aiohttp import web

from dht.errors import BadMessageError, DHTError, TransportError
from dht.identity import is_peer_id
from dht.net.client import API_VERSION, HELLO_HEADER, TUNNEL_HEADER
from dht.net.config import TransportConfig
from dht.net.door import RELAYED_FOR_HEADER, refuse_over_rate
from dht.net.limits import peer_host
from dht.net.server import HttpServer, Proven, Refused
from dht.net.session import digest, response_mac
from dht.net.shares import FairSlots, OverShare, Slot, address_key
from dht.reach.relay_mux import MAX_MESSAGE_BYTES, OPEN, Mux, MuxStream
from dht.reach.relay_shares import ByteRate, RelayShares

logger = logging.getLogger(__name__)

ATTACH_PATH = f"/{API_VERSION}/relay-attach"
RELAY_PREFIX = f"/{API_VERSION}/relay/"
# What a relay forwards: the versioned API of the relayed peer, nothing else.
_NAME = "[A-Za-z0-9._-]{1,64}"
FORWARDED_PATH = re.compile(rf"/{API_VERSION}/(hello|info|rpc/{_NAME}|stream/{_NAME})")
# (retry-after: a relayed peer's 429 tells its callers when to come back, as a direct one does)
FORWARDED_HEADERS = ("content-type", "retry-after")
# An HTTP header name (RFC 9110's token)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def forwarded_headers(headers) -> dict[str, str]:
    """The headers a relay carries across: the proof (``x-vp-*``), the content type and a
    refusal's ``Retry-After``; never the tunnel's own mark (a caller cannot pass for the
    relayed node's tunnel).

    Raises:
        BadMessageError: a name carried across is no HTTP token, or a value is not printable
            ASCII (aiohttp decodes request headers leniently, and would refuse either in an
            answer, once the answer had begun).
    """
    carried = {
        name.lower(): value
        for name, value in headers.items()
        if (name.lower().startswith("x-vp-") or name.lower() in FORWARDED_HEADERS)
        and name.lower() != TUNNEL_HEADER
    }
    for name, value in carried.items():
        if not _TOKEN.fullmatch(name):
            raise BadMessageError(f"header name {name[:64]!r} is not an HTTP token")
        if not (value.isascii() and value.isprintable()):
            raise BadMessageError(f"header {name} is not printable ASCII")
    return carried


class RelayService:
    """The tunnels of the peers relayed here, and the forwarding of requests to them.

    Args:
        server: this node's server (authenticates attaches; its refusal middleware answers).
        config: the relay's caps and timeouts (``max_relayed_*``, ``relay_heartbeat_s``).
    """

    def __init__(self, server: HttpServer, config: TransportConfig):
        self.server = server
        self.config = config
        self.shares = RelayShares(
            rate_per_s=config.max_relayed_bytes_per_s,
            rate_per_address_per_s=config.relayed_bytes_per_s_per_address(),
            max_seats=config.max_relayed_peers,
            max_seats_per_address=config.max_relayed_peers_per_address,
            max_requests_per_peer=config.max_relayed_requests_per_peer,
            max_requests_per_address=config.max_relayed_requests_per_address,
        )
        self.rate = self.shares.rate
        self._tunnels: dict[str, Mux] = {}
        self._seats: dict[str, Slot] = {}  # attached peer id -> its seat
        self.num_relayed_bytes = 0
        self.num_attaches = 0
        self._closed_reason: str | None = None

    @property
    def relayed_peers(self) -> list[str]:
        """Peer ids attached here now."""
        return list(self._tunnels)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(ATTACH_PATH, self._handle_attach)
        app.router.add_route("*", RELAY_PREFIX + "{peer_id}/{tail:.*}", self._handle_forward)

    async def close(self, reason: str = "relay shutting down") -> None:
        """Stop relaying: close every tunnel (their attach handlers return) and refuse new
        attaches (503, ``reason``); safe twice."""
        self._closed_reason = self._closed_reason or reason
        tunnels = list(self._tunnels.values())
        self._tunnels.clear()
        await asyncio.gather(*(mux.close(reason) for mux in tunnels))

    # ---- attach ------------------------------------------------------------------------------

    async def _handle_attach(self, request: web.Request) -> web.StreamResponse:
        proven = self.server.authenticate(request)
        if proven.body_digest != digest(b""):
            raise Refused(401, "an attach has an empty body: its digest must be of no bytes")
        peer_id = proven.peer_id
        if self._closed_reason is not None:
            raise Refused(503, self._closed_reason)
        # A new attach of an attached peer replaces its tunnel: the old one's seat is given up
        # first (its tunnel is closed once the new one is up, or now if the new one is refused).
        old_seat = self._seats.pop(peer_id, None)
        if old_seat is not None:
            self.shares.seats.release(old_seat)
        try:
            seat, evicted = self.shares.seats.take(address_key(peer_host(request.transport)))
        except OverShare as e:
            if (old := self._tunnels.get(peer_id)) is not None:
                await old.close("replaced by an attach that was refused")
            raise Refused(503, f"relay full: {e}") from None
        self._seats[peer_id] = seat
        try:
            if evicted is not None:  # a newcomer address's seat, from one over its share
                await _evict(evicted, "its address holds more than its fair share of seats")
            return await self._serve_tunnel(request, proven, seat)
        finally:
            self.shares.seats.release(seat)
            if self._seats.get(peer_id) is seat:
                del self._seats[peer_id]

    async def _serve_tunnel(
        self, request: web.Request, proven: Proven, seat: Slot
    ) -> web.StreamResponse:
        peer_id = proven.peer_id
        ws = web.WebSocketResponse(
            heartbeat=self.config.relay_heartbeat_s, compress=False, max_msg_size=MAX_MESSAGE_BYTES
        )
        ws.headers["x-vp-peer"] = self.server.peer_id
        ws.headers["x-vp-mac"] = response_mac(proven.key, proven.nonce, 101, digest(b""))
        await ws.prepare(request)
        mux = Mux(
            ws,
            idle_timeout_s=self.config.stream_idle_timeout_s,
            write_timeout_s=self.config.stream_write_timeout_s,
            max_streams=self.config.max_relayed_requests_per_peer,
        )
        seat.holder = mux
        if seat.evicted:  # (given to another address while this one was being set up)
            await mux.close("its address holds more than its fair share of seats")
            return ws
        old = self._tunnels.get(peer_id)
        self._tunnels[peer_id] = mux
        self.num_attaches += 1
        logger.info("relaying for %s (%d peers attached)", peer_id[:8], len(self._tunnels))
        if old is not None:
            await old.close("replaced by a new attach of the same peer")
        try:
            await mux.run()
        finally:
            if self._tunnels.get(peer_id) is mux:
                del self._tunnels[peer_id]
            logger.info("stopped relaying for %s", peer_id[:8])
        return ws

    # ---- forwarding --------------------------------------------------------------------------

    async def _handle_forward(self, request: web.Request) -> web.StreamResponse:
        host = peer_host(request.transport)
        # The relay holds no session with the caller (it cannot tell who it is), but it sees
        # its address: a forwarded request is one of that address's share of this node's
        # requests, checked first (a refusal is a 429 held for one that retries at once).
        refuse_over_rate(self.server.requests.take_address(host))
        peer_id, path = request.match_info["peer_id"], "/" + request.match_info["tail"]
        if not is_peer_id(peer_id):
            raise Refused(404, "a relayed address is /v2/relay/{64 hex peer id}")
        if request.method not in ("GET", "POST") or not FORWARDED_PATH.fullmatch(path):
            raise Refused(404, f"a relay forwards only /{API_VERSION}/ requests to relayed peers")
        mux = self._tunnels.get(peer_id)
        if mux is None:
            raise Refused(404, f"peer {peer_id[:16]} is not relayed here (not attached)")
        try:
            headers = forwarded_headers(request.headers)
        except BadMessageError as e:
            raise Refused(400, str(e)) from None
        # the relayed node charges its address shares to this (a caller's own is overwritten)
        headers[RELAYED_FOR_HEADER] = address_key(host)
        is_hello = path == f"/{API_VERSION}/hello" or HELLO_HEADER in request.headers
        if is_hello and not self.server.hellos.allow(host):
            # the relayed node cannot tell its callers apart by address: the relay does
            raise Refused(429, "too many handshakes from this address; slow down")
        length = request.content_length
        if length is not None and length > self.server.limits.max_body_bytes:
            raise Refused(413, f"body of {length} bytes exceeds the limit")
        rate = self.shares.address_rate(host)
        if rate.spent():  # only this address's own bucket: nobody else's requests are refused
            raise Refused(
                503, f"this address is over its share of {rate.rate_per_s:.0f} relayed bytes/s"
            )
        slots = self.shares.request_slots(peer_id)
        try:
            slot, evicted = slots.take(address_key(host))
        except OverShare as e:
            raise self._over_slots(host, slots, str(e)) from None
        try:
            if evicted is not None:  # a newcomer's slot, taken from an address over its share
                await _evict(evicted, "its address holds more than its fair share of slots")
            if slot.evicted:  # (taken in turn while the eviction above was being sent)
                raise self._over_slots(host, slots, _given_away(slots))
            if mux.num_streams >= mux.max_streams:  # (the slots keep below it: a safety net)
                raise Refused(503, f"more than {mux.max_streams} relayed requests to this peer")
            try:
                stream = mux.open()
            except TransportError as e:
                raise Refused(502, f"relayed peer went away: {e}") from None
            slot.holder = stream
            try:
                return await self._relay(request, stream, path, headers, rate)
            except Refused as e:
                if slot.evicted:  # cut for an address with fewer slots: the caller's doing
                    raise self._over_slots(host, slots, _given_away(slots)) from e
                raise
            finally:
                await stream.close("the caller's request ended")
        finally:
            self.shares.release_request(peer_id, slot)

    def _over_slots(self, host: str, slots: FairSlots, reason: str) -> Refused:
        """A 429 for an address over its share of a relayed peer's request slots: it empties
        the address's bucket of requests here, so that a retry at once is refused at the first
        check (and held if it keeps coming back). An address refused only because every holder
        is within its fair share did nothing wrong: its bucket is left alone."""
        key = address_key(host)
        if slots.held_by(key) >= min(slots.max_per_key, math.floor(slots.fair_share(key))):
            retry_after_s = self.server.requests.addresses.drain(key)
        else:
            retry_after_s = 1
        return Refused(429, reason, retry_after_s=retry_after_s)

    async def _relay(
        self, request: web.Request, stream: MuxStream, path: str, headers: dict, rate: ByteRate
    ) -> web.StreamResponse:
        """Forward the request and stream its answer back; every byte that crosses, either
        way, is paid as it crosses into the caller's bucket and the relay's."""
        opening = {"m": request.method, "p": path, "h": headers}
        up: asyncio.Task | None = None
        response: web.StreamResponse | None = None
        try:
            await stream.write_message(OPEN, opening)  # before any DATA of the body
            up = asyncio.create_task(self._pump_up(request, stream, rate))
            head = await stream.read_message()
            response = web.StreamResponse(status=_status(head), headers=_headers(head))
            await response.prepare(request)
            while (chunk := await stream.read()) is not None:
                self.num_relayed_bytes += len(chunk)
                await self.shares.pay(rate, len(chunk))
                async with asyncio.timeout(self.config.stream_write_timeout_s):
                    await response.write(chunk)
            await response.write_eof()
            return response
        except (DHTError, TimeoutError, ConnectionError) as e:
            # DHTError: the relayed peer broke the tunnel's protocol (a DATA before its HEAD, a
            # second HEAD): its caller gets a 502 like for any other failure of the peer
            if response is None:
                raise Refused(502, f"relayed peer did not answer: {e}") from None
            if request.transport is not None:
                request.transport.abort()  # the caller sees a cut answer, not a short one
            return response
        finally:
            if up is not None:
                up.cancel()
                await asyncio.gather(up, return_exceptions=True)

    async def _pump_up(self, request: web.Request, stream: MuxStream, rate: ByteRate) -> None:
        # No stall timeout here: the relayed peer's server times the body out itself (an RPC's
        # within body_stall_timeout_s, a stream's per frame) and answers, which ends this.
        try:
            async for chunk in request.content.iter_any():
                self.num_relayed_bytes += len(chunk)
                await self.shares.pay(rate, len(chunk))
                await stream.write(chunk)
            await stream.end()
        except Exception as e:  # whatever cut the caller's body, the relayed peer must hear it
            await stream.reset(f"caller's request failed: {type(e).__name__} {e}"[:200])


def _given_away(slots: FairSlots) -> str:
    return (
        f"one of this address's {slots.unit} was given to another address: "
        "it held more than its fair share"
    )


async def _evict(slot: Slot, reason: str) -> None:
    """Stop what held an evicted slot: a forwarded request's tunnel stream, reset (its RESET
    goes before the newcomer's OPEN, so the relayed peer never counts both), or a tunnel."""
    holder = slot.holder
    if isinstance(holder, MuxStream):
        await holder.reset(reason)
    elif isinstance(holder, Mux):
        await holder.close(reason)


def _status(head: dict) -> int:
    status = head.get("s")
    if type(status) is not int or not 100 <= status <= 599 or status == 101:
        raise TransportError(f"relayed peer answered a bad status {status!r}")
    return status


def _headers(head: dict) -> dict[str, str]:
    headers = head.get("h")
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _TOKEN.fullmatch(k)
        for k, v in headers.items()
    ):  # a name that is no token is malformed even where it would not be carried across
        raise TransportError("relayed peer answered malformed headers")
    return forwarded_headers(headers)
