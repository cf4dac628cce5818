"""The door of the node's server: what a request must pass before the node works for it, and how
it is turned away.

A request passes its source address's share of requests (:mod:`dht.net.request_shares`) before
anything else, then its session ticket, MAC, timestamp and nonce (headers only), with its proven
peer's share of requests checked right after the MAC. A handshake passes its address's share of
requests and of handshakes before its body is read. Past a share the answer is 429 with a
``Retry-After``, held for a sender that came back before it was told to. Every refusal is a
4xx/5xx whose reason is in the ``x-vp-error`` header and the body, logged as one line (at most
one a second per status under a flood). Connections are counted one step earlier still, in
:class:`dht.net.limits.ConnectionGate`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from dataclasses import dataclass

from aiohttp import web

from dht.errors import AuthError
from dht.net.client import API_VERSION, TUNNEL_HEADER
from dht.net.config import TransportConfig
from dht.net.limits import peer_host
from dht.net.refusals import ClientGone, Refused, error_response
from dht.net.replay import ReplayGuard
from dht.net.request_shares import RateRefusal, RequestShares
from dht.net.session import macs_equal, request_mac
from dht.net.session_issuer import SessionIssuer
from dht.net.shares import RELAYED_SHARE_PREFIX, address_key

logger = logging.getLogger("dht.net.server")  # (the refusals' log lines keep their old name)

_HEX = re.compile(r"[0-9a-f]+")
# The caller's source address as the relay saw it (its IPv4 address or IPv6 /64), set by the
# relay on every request it forwards (a caller's own is overwritten there): a hint only, charged
# under its own name (``relayed/...``), never taken for a real source address.
RELAYED_FOR_HEADER = "x-vp-relayed-for"


@dataclass(frozen=True)
class Proven:
    """An authenticated request: who sent it, the session key, and what its MAC covered."""

    peer_id: str
    key: bytes
    nonce: str
    body_digest: bytes
    host: str
    share_host: str = ""  # what its address's shares are charged under (see Door.share_host)


class Door:
    """The checks a request passes before it is worked on, and the refusals of those that fail.

    Args:
        config: the shares, the replay window and the hold of refusals.
    """

    def __init__(self, config: TransportConfig):
        self.requests = RequestShares(
            rate_per_s_per_peer=config.max_requests_per_s_per_peer,
            burst_per_peer=config.request_burst_per_peer,
            rate_per_s_per_address=config.max_requests_per_s_per_address,
            burst_per_address=config.request_burst_per_address,
            handshakes_per_s_per_address=config.max_handshakes_per_s_per_address,
            handshake_burst=config.handshake_burst,
            max_hold_s=config.max_refusal_hold_s,
            contention_window_s=config.request_contention_window_s,
        )
        self.replay = ReplayGuard(
            window_s=config.replay_window_s, max_entries=config.max_remembered_nonces
        )
        self.num_refused = 0
        self._last_log_s: dict[int, float] = {}
        # Set while this node is relayed (dht.reach.relay_client): its tunnel's local requests carry
        # it, so they are known to come through the relay and not from this host.
        self.tunnel_token: str | None = None

    def source_host(self, request: web.Request) -> str:
        """The source IP of a request; "" for one that came through this node's relay tunnel
        (the relay already applied its per-address limits, and this node cannot verify the
        caller's address: its claims are pinged back)."""
        return "" if self._through_tunnel(request) else peer_host(request.transport)

    def _through_tunnel(self, request: web.Request) -> bool:
        token = self.tunnel_token
        return token is not None and macs_equal(token, request.headers.get(TUNNEL_HEADER, ""))

    def share_host(self, request: web.Request, host: str) -> str:
        """What the address shares of a request from ``host`` (its :meth:`source_host`) are
        charged under: ``host`` itself, or for a request through this node's relay tunnel the
        caller's address the relay passed (``relayed/{address}``: a key of its own, so that a
        relay that lies can neither pass for a real address nor take another address's share
        away; its callers' proven peer ids are charged whatever it says); "" (not counted, as
        before relays passed it) if the relay passed none that parses."""
        if not self._through_tunnel(request):
            return host
        return relayed_share_host(request.headers.get(RELAYED_FOR_HEADER, ""))

    def admit_hello(self, request: web.Request) -> str:
        """Let a handshake in (its address's share of requests and of handshakes, before its
        body is read); the host its shares are charged under."""
        host = self.share_host(request, self.source_host(request))
        refuse_over_rate(self.requests.take_hello(host))
        return host

    def authenticate(self, request: web.Request, issuer: SessionIssuer) -> Proven:
        """Check a request's session ticket, MAC, timestamp and nonce (headers only), each
        within its sender's share of requests: its source address's before anything else, its
        proven peer id's once the MAC checks."""
        host = self.source_host(request)
        share_host = self.share_host(request, host)
        refuse_over_rate(self.requests.take_address(share_host))
        ticket = request.headers.get("x-vp-ticket", "")
        if not ticket or len(ticket) > 512 or not printable_ascii(ticket):
            raise Refused(
                401, f"no session: make one first (POST /{API_VERSION}/hello)", renew=True
            )
        try:
            caller = issuer.open_ticket(ticket)
        except AuthError as e:
            raise Refused(401, str(e), renew=True) from None
        claimed = request.headers.get("x-vp-peer")
        if claimed is not None and claimed != caller.peer_id:
            raise Refused(401, "x-vp-peer is not the peer the session was made with")
        nonce = _hex_header(request, "x-vp-nonce", 32)
        body_digest = bytes.fromhex(_hex_header(request, "x-vp-digest", 64))
        mac = _hex_header(request, "x-vp-mac", 64)
        ts = request.headers.get("x-vp-ts", "")[:32]
        if not printable_ascii(ts):  # (headers are decoded leniently: anything may be here)
            raise Refused(401, "malformed x-vp-ts header")
        expected = request_mac(caller.key, request.method, request.path, body_digest, ts, nonce)
        if not macs_equal(expected, mac):
            raise Refused(401, "wrong request MAC")
        refuse_over_rate(self.requests.take_peer(caller.peer_id))
        try:
            self.replay.check(caller.peer_id, nonce, ts)
        except AuthError as e:
            raise Refused(401, str(e)) from None
        return Proven(caller.peer_id, caller.key, nonce, body_digest, host, share_host)

    def refused_for_share(self, peer: str, status: int, reason: str) -> Refused:
        """A refusal because ``peer`` holds its share of a pool (429): its request bucket is
        emptied, so that a retry at once costs only the door's check (see
        :meth:`RequestShares.drain`)."""
        if status != 429:
            return Refused(status, reason)
        return Refused(429, reason, retry_after_s=self.requests.drain(peer))

    @web.middleware
    async def refusals(self, request: web.Request, handler) -> web.StreamResponse:
        """The middleware that answers every refusal (and a caller that hung up) quietly."""
        try:
            return await handler(request)
        except ClientGone as e:
            logger.debug("caller of %s went away: %s", request.path[:80], e)
            return web.Response(status=400, text="request cut short")
        except Refused as e:
            refused = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            refused = Refused(e.status, e.reason)
        self.num_refused += 1
        self._log_refusal(request, refused.status, refused.reason)
        if refused.hold_s > 0:  # it ignored its last Retry-After: this answer waits for it
            await asyncio.sleep(refused.hold_s)
        return error_response(
            refused.status, refused.reason, renew=refused.renew,
            retry_after_s=refused.retry_after_s,
        )  # fmt: skip

    def _log_refusal(self, request: web.Request, status: int, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_log_s.get(status, -float("inf")) < 1.0:
            return  # one line per second per status: a flood must not flood the log
        self._last_log_s[status] = now
        sender = request.headers.get("x-vp-peer", "?")[:16]
        sender = sender if printable_ascii(sender) else "?"
        host = peer_host(request.transport)
        logger.warning(
            "refused %s %s from %s (%s): %d %s (%d refusals so far)",
            request.method, request.path[:80].encode("ascii", "backslashreplace").decode(),
            sender, host, status, reason,
            self.num_refused,
        )  # fmt: skip


def refuse_over_rate(refusal: RateRefusal | None) -> None:
    """Raise the 429 of a share's refusal, if any."""
    if refusal is not None:
        raise Refused(
            429, refusal.reason, retry_after_s=refusal.retry_after_s, hold_s=refusal.hold_s
        )


def relayed_share_host(hint: str) -> str:
    """The share key of a relayed caller's address ``hint`` (an IP address or an IPv6
    network, as :func:`dht.net.shares.address_key` writes it): ``relayed/{its address key}``;
    "" for a hint that is missing or does not parse."""
    if not hint or len(hint) > 64:
        return ""
    try:
        network = ipaddress.ip_network(hint, strict=False)
    except ValueError:
        return ""
    return RELAYED_SHARE_PREFIX + address_key(str(network.network_address))


def printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _hex_header(request: web.Request, name: str, length: int) -> str:
    value = request.headers.get(name, "")
    if len(value) != length or not _HEX.fullmatch(value):
        raise Refused(401, f"missing or malformed {name} header")
    return value
