"""Reachability: can the swarm dial this node at the address it would announce?

**The RPC** (``dial_back``, served by every node that serves): the body is ``{port, tls}``
(:class:`dht.net.schema.DialBackRequest`). The node dials ``http(s)://{source IP}:{port}``: only the
caller's own source IP, never an address the caller names, so it cannot be used to make
connections to third parties. There it makes a fresh handshake that must prove the caller's
peer id (a signed hello reply), within ``dial_back_timeout_s``, and answers
``{reachable, observed_host}`` (the source IP it saw). Dial-backs are rate-limited per source IP
and capped in number at once (429 beyond).

**The check** (:func:`check_reachability`, the joining side): it asks up to
``num_peers_asked`` of its initial peers at once. Their answers are not trusted blindly: a
"reachable" counts only when this node's own server received a signed hello from the very peer
that answered (proven by its session) after the question was sent. A positive is thus proven
by something no liar can fake without actually dialling in, and one proven positive is enough;
a negative cannot be proven either way, and its consequence (client mode) is the safe one, so
a node with no proven positive is not reachable. Answers that failed leave the result unknown
when none came back.

**The decision** (:func:`settle_reachability`): not reachable -> the node asks its gateway for a
port mapping (:mod:`dht.reach.port_mapping`, UPnP-IGD), announces the mapped address and asks again;
a mapping nobody can dial is deleted; still not reachable -> relayed by an initial peer, or else
the server is closed and the node has no address (client mode); reachable while listening on
a wildcard with no announced host -> the observed host becomes the announced one (hivemind users
get this from identify); no peers to ask, or none answered -> as configured.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

from dht.errors import BusyError, DHTError, RemoteError, TransportError
from dht.net.config import ReachabilityConfig
from dht.net.limits import RateLimiter
from dht.net.schema import DialBackAnswer, DialBackRequest, parse
from dht.net.transport import RequestContext, Transport
from dht.reach.port_mapping import open_port_mapping

if TYPE_CHECKING:
    from dht.net.config import TransportConfig
    from dht.reach.port_mapping import PortMapping
    from dht.reach.relay_client import AddressListener, Candidates

logger = logging.getLogger(__name__)

DIAL_BACK = "dial_back"
RELAY_PATH = "/v2/relay/"  # a relayed peer's address: {relay base URL}/v2/relay/{peer id}
_RETRY_S = 0.25  # pause before asking a peer again whose connection failed (still starting)
_BUSY_RETRY_S = 1.0  # pause before asking a peer again that said it is busy (429)

Path = Literal["direct", "relayed", "client"]


class NodeTransport(Transport, Protocol):
    """What reachability needs of the node's assembled transport (:class:`dht.http.HttpTransport`).

    Reachability sits below the assembly that uses it, so it names the members it needs here
    instead of importing the class.
    """

    config: TransportConfig
    reachability: Reachability | None
    port_mapping: PortMapping | None

    def hello_seen_since(self, peer_id: str, since_s: float) -> bool: ...

    async def dial(self, address: str, *, expected_peer: str, timeout_s: float) -> None: ...

    async def stop_serving(self) -> None: ...

    def announce_host(self, host: str) -> None: ...

    def announce_address(self, host: str, port: int) -> None: ...

    async def attach_relay(
        self, candidates: Candidates, *, on_address_change: AddressListener | None = None
    ) -> str: ...


@dataclass(frozen=True, kw_only=True)
class Reachability:
    """What a node learned about how the swarm reaches it.

    Attributes:
        reachable: True (a peer proved it dialled in), False (none did), None (not checked:
            client mode as configured, no peers to ask, or none answered).
        address: the address others use (None: client mode).
        observed_host: the source IP the peers saw this node come from, when they said.
        num_asked: peers asked; num_answered: peers that answered; num_confirmed: answers of
            "reachable" proven by a hello from that peer.
        reason: why, in words (for the unknown and not-reachable cases).
        port_mapped_by: how the gateway was asked to forward the port others dial
            (``"UPnP"``), when a mapping made this node reachable.
    """

    reachable: bool | None
    address: str | None
    observed_host: str | None = None
    num_asked: int = 0
    num_answered: int = 0
    num_confirmed: int = 0
    reason: str = ""
    port_mapped_by: str | None = None

    @property
    def path(self) -> Path:
        """How others reach this node: ``direct``, ``relayed`` or ``client`` (not at all)."""
        return path_of(self.address)


def path_of(address: str | None) -> Path:
    """How others reach a peer with this announced address (the dashboard's "path")."""
    if not address:
        return "client"
    return "relayed" if RELAY_PATH in address else "direct"


def reachability_line(reach: Reachability) -> str:
    """The one line ``peer join`` prints about reachability (extend here, e.g. for relays)."""
    if reach.address is not None and reach.path == "relayed":
        return f"not reachable from the swarm: relayed via {reach.address.split(RELAY_PATH)[0]}"
    if reach.reachable and reach.port_mapped_by:
        return f"reachable at {reach.address} (port mapped by {reach.port_mapped_by})"
    if reach.reachable:
        return f"reachable at {reach.address}"
    if reach.reachable is False:
        return "not reachable from the swarm: client mode"
    if reach.address is None:
        return "client mode as configured: reachability not checked"
    return f"reachability unknown ({reach.reason}): serving at {reach.address}"


# ---- the node's side: answering dial-backs ------------------------------------------------------


class DialBackService:
    """Answers ``dial_back``: dials the caller's source IP and proves the caller is there.

    Args:
        transport: the node's transport (dials with its client session and identity).
        config: timeouts and rates.
    """

    def __init__(self, transport: NodeTransport, config: ReachabilityConfig):
        self.transport = transport
        self.config = config
        self.rates = RateLimiter(
            rate_per_s=config.max_dial_backs_per_s_per_address, burst=config.dial_back_burst
        )
        self.num_in_progress = 0
        self.num_served = 0

    async def handle(self, ctx: RequestContext, payload: Any) -> dict:
        request = parse(DialBackRequest, payload)
        host = _plain_ip(ctx.remote_host)
        if not host:
            return {"reachable": False, "observed_host": ""}
        if not self.rates.allow(host):
            raise BusyError("too many dial-backs for this address; ask again later")
        if self.num_in_progress >= self.config.max_concurrent_dial_backs:
            raise BusyError("too many dial-backs in progress; ask again later")
        self.num_in_progress += 1
        try:
            reachable = await self._dial(host, request, ctx.sender)
        finally:
            self.num_in_progress -= 1
        self.num_served += 1
        return {"reachable": reachable, "observed_host": host}

    async def _dial(self, host: str, request: DialBackRequest, sender: str) -> bool:
        url_host = f"[{host}]" if ":" in host else host
        address = f"{'https' if request.tls else 'http'}://{url_host}:{request.port}"
        try:
            await self.transport.dial(
                address, expected_peer=sender, timeout_s=self.config.dial_back_timeout_s
            )
        except DHTError as e:  # refused, timed out, another peer there: not reachable
            logger.debug("dial-back to %s for %s failed: %s", address, sender[:8], e)
            return False
        return True


def _plain_ip(host: str) -> str:
    """``host`` with an IPv4-mapped IPv6 address (a dual-stack listener's) as plain IPv4."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ""
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


# ---- the joining side: asking ------------------------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    peer_id: str
    answer: DialBackAnswer
    confirmed: bool


async def check_reachability(
    transport: NodeTransport, peers: list[str] | tuple[str, ...], config: ReachabilityConfig
) -> Reachability:
    """Ask distinct ``peers`` to dial this node back; see the module docstring.

    Never raises for the network: peers that fail or refuse count as not answering.
    """
    own = transport.address
    if own is None:
        return Reachability(reachable=None, address=None, reason="client mode as configured")
    asked = list(dict.fromkeys(p for p in peers if p != own))[: config.num_peers_asked]
    if not asked:
        return Reachability(reachable=None, address=own, reason="no peers to ask")
    own_url = urlsplit(own)
    request = {"port": own_url.port, "tls": own_url.scheme == "https"}
    since_s = time.monotonic()
    deadline_s = since_s + config.check_timeout_s
    results = await asyncio.gather(
        *(_ask(transport, peer, request, since_s, deadline_s) for peer in asked)
    )
    answers = list({a.peer_id: a for a in results if a is not None}.values())  # distinct peers
    return _decide(own, len(asked), answers)


def _decide(own: str, num_asked: int, answers: list[_Answer]) -> Reachability:
    confirmed = [a for a in answers if a.confirmed]
    for a in answers:
        if a.answer.reachable and not a.confirmed:
            logger.warning("peer %s says this node is reachable but never dialled in", a.peer_id)
    # the host most proven answers saw (a liar with a proven answer is outvoted), else any
    observed = collections.Counter(
        a.answer.observed_host for a in confirmed
    ) or collections.Counter(a.answer.observed_host for a in answers)
    observed.pop("", None)
    observed_host = observed.most_common(1)[0][0] if observed else None
    counts = {"num_asked": num_asked, "num_answered": len(answers)}
    if not answers:
        reason = "none of the peers asked answered"
        return Reachability(reachable=None, address=own, reason=reason, **counts)
    if not confirmed:
        port = urlsplit(own).port
        reason = f"none of {len(answers)} peers could dial port {port} on {observed_host}"
        return Reachability(
            reachable=False, address=own, observed_host=observed_host, reason=reason, **counts
        )
    return Reachability(
        reachable=True,
        address=own,
        observed_host=observed_host,
        num_confirmed=len(confirmed),
        **counts,
    )


async def _ask(
    transport: NodeTransport, peer: str, request: dict, since_s: float, deadline_s: float
) -> _Answer | None:
    """One peer's answer, asked again while its connection fails (it may still be starting)."""
    while True:
        try:
            timeout_s = deadline_s - time.monotonic()
            if timeout_s <= 0:
                return None
            payload = await transport.call(peer, DIAL_BACK, request, timeout_s=timeout_s)
            answer = parse(DialBackAnswer, payload)
        except (RemoteError, TransportError) as e:
            # busy (429: many peers joining from one address at once) or not up yet: again
            retry = not isinstance(e, RemoteError) or e.status == 429
            pause_s = _BUSY_RETRY_S if isinstance(e, RemoteError) else _RETRY_S
            if not retry or time.monotonic() + pause_s >= deadline_s:
                logger.info("no dial-back from %s: %s", peer, e)
                return None
            await asyncio.sleep(pause_s)
            continue
        except DHTError as e:  # a malformed answer
            logger.warning("peer %s answered a dial-back wrongly: %s", peer, e)
            return None
        peer_id = transport.peer_at(peer)
        if peer_id is None:
            return None
        confirmed = answer.reachable and transport.hello_seen_since(peer_id, since_s)
        return _Answer(peer_id, answer, confirmed)


# ---- the decision ------------------------------------------------------------------------------


async def settle_reachability(
    transport: NodeTransport,
    peers: list[str] | tuple[str, ...],
    config: ReachabilityConfig,
    *,
    relays: Candidates | None = None,
) -> Reachability:
    """Check, then act on it: the one place where automatic relaying and client mode are
    decided.

    Call after the transport started and before the DHT node starts (nothing has announced
    the address yet). A node nobody can dial asks its gateway for a port mapping and keeps it
    (``transport.port_mapping``, deleted when the transport closes) if the peers can then dial
    it; otherwise it attaches to the first of ``relays`` that accepts
    (its address becomes the relayed one), or, with none, runs in client mode. The result is
    also kept as ``transport.reachability``.
    """
    reach = await check_reachability(transport, peers, config)
    if reach.reachable is False and config.try_port_mapping:
        reach = await _through_port_mapping(transport, peers, config, reach)
    if reach.reachable is False and relays:
        reach = await _relayed_or_client(transport, reach, relays)
    elif reach.reachable is False:
        await transport.stop_serving()  # client mode from here: no address, no server
        reach = _replace_address(reach, None)
    elif reach.reachable and reach.observed_host and _announces_wildcard(transport):
        transport.announce_host(reach.observed_host)
        reach = _replace_address(reach, transport.address)
    transport.reachability = reach
    return reach


async def _through_port_mapping(
    transport: NodeTransport,
    peers: list[str] | tuple[str, ...],
    config: ReachabilityConfig,
    reach: Reachability,
) -> Reachability:
    """``reach`` again, with the port mapped on the gateway if that made the node reachable."""
    own = urlsplit(transport.address)
    local_host = None if _announces_wildcard(transport) else transport.config.host
    if local_host is not None and _is_loopback(local_host):
        return reach  # a gateway cannot forward to a loopback listener
    mapping = await open_port_mapping(own.port, config.port_mapping, internal_host=local_host)
    if mapping is None:
        return reach
    # peers dial back the address they see this node come from: announce that one
    transport.announce_address(reach.observed_host or mapping.external_host, mapping.external_port)
    try:
        again = await check_reachability(transport, peers, config)
    except BaseException:  # cancelled: no mapping is left open behind
        await mapping.close()
        raise
    if not again.reachable:
        logger.info("port mapped by %s (%s), yet no peer could dial it", mapping.method, mapping)
        transport.announce_address(own.hostname, own.port)
        await mapping.close()
        return reach
    logger.info("port mapped by %s (%s): reachable at %s", mapping.method, mapping, again.address)
    mapping.start_renewing()
    transport.port_mapping = mapping
    return dataclasses.replace(again, port_mapped_by=mapping.method)


async def _relayed_or_client(
    transport: NodeTransport, reach: Reachability, relays: Candidates
) -> Reachability:
    try:
        address = await transport.attach_relay(relays)
    except TransportError as e:
        logger.warning("no relay accepted this peer (%s): client mode", e)
        await transport.stop_serving()
        return _replace_address(reach, None)
    return _replace_address(reach, address)  # its path reads "relayed" from the address


def _announces_wildcard(transport: NodeTransport) -> bool:
    cfg = transport.config
    if cfg.announce_host:
        return False
    try:
        return ipaddress.ip_address(cfg.host).is_unspecified
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _replace_address(reach: Reachability, address: str | None) -> Reachability:
    return dataclasses.replace(reach, address=address)
