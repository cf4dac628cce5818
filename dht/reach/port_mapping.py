"""A port mapping on the home gateway (UPnP-IGD), for a node the swarm cannot dial.

Most home routers forward a port on request (UPnP Internet Gateway Device): the node finds the
gateway by SSDP (a multicast search on the LAN, answered within ``discovery_timeout_s``),
reads its external address and asks it to forward TCP ``external_port`` to this node's
listening port. :func:`open_port_mapping` returns the mapping, or None when there is no
gateway or it refuses (nothing else changes then). A mapping is leased for ``lease_s`` and
renewed at half of that, and :meth:`PortMapping.close` deletes it: a peer that leaves leaves
no open port behind (a crashed one's lapses with the lease). Whether the mapping really makes
the node reachable is decided by the swarm's dial-back (:mod:`dht.reach.reachability`), not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from urllib.parse import urlsplit

from async_upnp_client.aiohttp import AiohttpRequester
from async_upnp_client.client import UpnpService
from async_upnp_client.client_factory import UpnpFactory
from async_upnp_client.exceptions import UpnpError
from async_upnp_client.search import SsdpSearchListener

from dht.net.config import PortMappingConfig

logger = logging.getLogger(__name__)

IGD_TYPES = (
    "urn:schemas-upnp-org:device:InternetGatewayDevice:2",
    "urn:schemas-upnp-org:device:InternetGatewayDevice:1",
)
# the services that forward ports (a DSL modem's is WANPPPConnection)
CONNECTION_TYPES = (
    "urn:schemas-upnp-org:service:WANIPConnection:2",
    "urn:schemas-upnp-org:service:WANIPConnection:1",
    "urn:schemas-upnp-org:service:WANPPPConnection:1",
)
ONLY_PERMANENT_LEASES = 725  # UPnP error: the gateway takes only lease 0 (until deleted)
_DYNAMIC_PORTS = (49152, 65535)  # where another external port is tried when ours is taken


class PortMapping:
    """A TCP port mapping held on a gateway: renewed until :meth:`close` deletes it.

    Attributes:
        method: how it was made (``"UPnP"``).
        external_host: the gateway's external address, as it says.
        external_port: the port others dial on the gateway.
        internal_host, internal_port: where the gateway forwards to (this node).
        lease_s: the lease asked for (0: until deleted; the gateway takes no other).
    """

    method = "UPnP"

    def __init__(
        self,
        service: UpnpService,
        config: PortMappingConfig,
        *,
        external_host: str,
        external_port: int,
        internal_host: str,
        internal_port: int,
        lease_s: int,
    ):
        self._service = service
        self._config = config
        self.external_host = external_host
        self.external_port = external_port
        self.internal_host = internal_host
        self.internal_port = internal_port
        self.lease_s = lease_s
        self._renewal: asyncio.Task | None = None
        self._closed = False

    def start_renewing(self) -> None:
        """Renew the lease at half its length until closed (nothing to do for lease 0)."""
        if self.lease_s and self._renewal is None and not self._closed:
            self._renewal = asyncio.create_task(self._renew(), name="port-mapping-renewal")

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 2)
            try:
                await _add(self._service, self._config, self, self.external_port, self.lease_s)
            except (UpnpError, OSError, TimeoutError) as e:  # the next try may work
                logger.warning("could not renew the port mapping %s: %s", self, e)

    async def close(self) -> None:
        """Stop renewing and delete the mapping; safe to call twice, never raises for the
        network (the lease ends it anyway)."""
        if self._closed:
            return
        self._closed = True
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
        try:
            await asyncio.wait_for(
                self._service.action("DeletePortMapping").async_call(
                    NewRemoteHost="", NewExternalPort=self.external_port, NewProtocol="TCP"
                ),
                self._config.request_timeout_s,
            )
        except (UpnpError, OSError, TimeoutError) as e:
            logger.warning("could not delete the port mapping %s: %s", self, e)
        else:
            logger.info("deleted the port mapping %s", self)

    def __str__(self) -> str:
        return (
            f"{self.external_host}:{self.external_port} -> "
            f"{self.internal_host}:{self.internal_port}"
        )


async def open_port_mapping(
    internal_port: int, config: PortMappingConfig, *, internal_host: str | None = None
) -> PortMapping | None:
    """Ask the LAN's gateway to forward TCP to ``internal_port`` on this host.

    Args:
        internal_port: the port this node listens on.
        config: timeouts, lease and ports to try.
        internal_host: this host's LAN address; by default the one it reaches the gateway
            from.

    Returns:
        The mapping (not yet renewing: call :meth:`PortMapping.start_renewing` to keep it),
        or None: no gateway answered within ``discovery_timeout_s``, or it refused (logged).
    """
    location = await _discover(config.discovery_timeout_s)
    if location is None:
        logger.info(
            "no UPnP gateway answered within %s s: no port mapping", config.discovery_timeout_s
        )
        return None
    try:
        service = await asyncio.wait_for(
            _connection_service(location, config), config.request_timeout_s
        )
        if service is None:
            logger.info("the gateway at %s forwards no ports (no WAN connection service)", location)
            return None
        answer = await asyncio.wait_for(
            service.action("GetExternalIPAddress").async_call(), config.request_timeout_s
        )
        host = internal_host or _local_address_towards(urlsplit(location).hostname or "")
        return await _map(service, config, str(answer["NewExternalIPAddress"]), host, internal_port)
    except (UpnpError, OSError, TimeoutError, KeyError) as e:
        logger.info("the UPnP gateway at %s made no port mapping: %s", location, e)
        return None


async def _discover(timeout_s: float) -> str | None:
    """The description URL of the first gateway that answers an SSDP search, if any."""
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_answer(headers: dict) -> None:
        if headers.get("st") in IGD_TYPES and headers.get("location") and not found.done():
            found.set_result(headers["location"])

    # MX (how long gateways may wait before answering) in whole seconds, within our wait
    listener = SsdpSearchListener(
        async_callback=on_answer, search_target=IGD_TYPES[1], timeout=max(1, int(timeout_s / 2))
    )
    try:
        await listener.async_start()
    except OSError as e:  # no multicast route (no LAN at all)
        logger.info("no SSDP search possible: %s", e)
        return None
    try:
        listener.async_search()
        return await asyncio.wait_for(found, timeout_s)
    except (TimeoutError, OSError):
        return None
    finally:
        listener.async_stop()


async def _connection_service(location: str, config: PortMappingConfig) -> UpnpService | None:
    requester = AiohttpRequester(timeout=max(1, int(config.request_timeout_s)))
    device = await UpnpFactory(requester).async_create_device(location)
    for service_type in CONNECTION_TYPES:
        for service in device.all_services:
            if service.service_type == service_type and service.has_action("AddPortMapping"):
                return service
    return None


async def _map(
    service: UpnpService, config: PortMappingConfig, external_host: str, host: str, port: int
) -> PortMapping | None:
    ports = [port] + [random.randint(*_DYNAMIC_PORTS) for _ in range(config.num_port_attempts - 1)]
    for external_port in ports:
        mapping = PortMapping(
            service, config, external_host=external_host, external_port=external_port,
            internal_host=host, internal_port=port, lease_s=config.lease_s,
        )  # fmt: skip
        try:
            await _add(service, config, mapping, external_port, config.lease_s)
        except UpnpError as e:
            if getattr(e, "error_code", None) == ONLY_PERMANENT_LEASES:
                mapping.lease_s = 0
                await _add(service, config, mapping, external_port, 0)
            else:
                logger.info("the gateway refused port %s: %s", external_port, e)
                continue
        return mapping
    return None


async def _add(
    service: UpnpService, config: PortMappingConfig, mapping: PortMapping, ext: int, lease_s: int
) -> None:
    await asyncio.wait_for(
        service.action("AddPortMapping").async_call(
            NewRemoteHost="",
            NewExternalPort=ext,
            NewProtocol="TCP",
            NewInternalPort=mapping.internal_port,
            NewInternalClient=mapping.internal_host,
            NewEnabled=True,
            NewPortMappingDescription=config.description,
            NewLeaseDuration=lease_s,
        ),
        config.request_timeout_s,
    )


def _local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 1900))
        return probe.getsockname()[0]
