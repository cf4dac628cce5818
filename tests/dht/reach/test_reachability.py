"""Dial-back and the reachability check between real transports on loopback.

A node bound to 127.0.0.2 calls out from 127.0.0.1 (the kernel's source address towards
127.0.0.1), so a dial-back to its source IP finds nobody: the loopback stand-in for a peer
behind a NAT or a firewall. The NAT itself is in tests/experiments/launch/test_nat_swarm.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from urllib.parse import urlsplit

import pytest

from dht.errors import ConfigError, RemoteError
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import PortMappingConfig, TransportConfig
from dht.reach.reachability import (
    DIAL_BACK,
    Reachability,
    ReachabilityConfig,
    check_reachability,
    path_of,
    reachability_line,
    settle_reachability,
)
from peer.run.config import PeerConfig

pytestmark = pytest.mark.timeout(60)
FAST = ReachabilityConfig(dial_back_timeout_s=2.0, check_timeout_s=4.0)


@asynccontextmanager
async def transports(*configs: TransportConfig) -> AsyncIterator[list[HttpTransport]]:
    async with AsyncExitStack() as stack:
        started = []
        for config in configs:
            transport = HttpTransport(PeerIdentity.generate(), config)
            started.append(await stack.enter_async_context(transport))
        yield started


def port_of(address: str) -> int:
    return urlsplit(address).port


def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_node_on_loopback_is_reachable_at_its_address():
    async with transports(TransportConfig(), TransportConfig()) as (boot, joiner):
        reach = await settle_reachability(joiner, [boot.address], FAST)
        assert reach.reachable is True and reach.num_confirmed == 1
        assert reach.address == joiner.address and reach.observed_host == "127.0.0.1"
        assert reach.path == "direct" and joiner.reachability == reach
        assert reachability_line(reach) == f"reachable at {joiner.address}"
        assert boot.dial_back.num_served == 1


async def test_a_node_nobody_can_dial_turns_to_client_mode():
    hidden = TransportConfig(host="127.0.0.2")  # its calls come from 127.0.0.1
    async with transports(TransportConfig(), hidden) as (boot, joiner):
        assert joiner.address.startswith("http://127.0.0.2:")
        reach = await settle_reachability(joiner, [boot.address], FAST)
        assert reach.reachable is False and reach.observed_host == "127.0.0.1"
        assert reach.address is None and joiner.address is None and joiner.server is None
        assert reach.path == "client"
        assert reachability_line(reach) == "not reachable from the swarm: client mode"
        # still a client of the swarm
        assert (await joiner.call(boot.address, DIAL_BACK, {"port": 1}))["reachable"] is False


async def test_dial_back_dials_only_the_callers_own_ip_and_proves_the_caller():
    async with transports(TransportConfig(), TransportConfig(), TransportConfig()) as nodes:
        boot, caller, bystander = nodes
        answer = await caller.call(boot.address, DIAL_BACK, {"port": unused_port()})
        assert answer == {"reachable": False, "observed_host": "127.0.0.1"}
        # another peer serves on that port: it cannot prove the caller's id, so no
        answer = await caller.call(boot.address, DIAL_BACK, {"port": port_of(bystander.address)})
        assert answer["reachable"] is False
        answer = await caller.call(boot.address, DIAL_BACK, {"port": port_of(caller.address)})
        assert answer["reachable"] is True
        # naming a host to dial is not part of the request: refused, nothing dialled
        for extra in ({"host": "10.0.0.1"}, {"address": "http://10.0.0.1:80"}):
            with pytest.raises(RemoteError) as refused:
                await caller.call(boot.address, DIAL_BACK, {"port": 80, **extra})
            assert refused.value.status == 400 and "Extra inputs" in refused.value.reason
        assert boot.dial_back.num_served == 3


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({}, "port"),
        ({"port": 0}, "port"),
        ({"port": 65536}, "port"),
        ({"port": "80"}, "port"),
        ({"port": True}, "port"),
        ({"port": 80, "tls": 1}, "tls"),
        ([80], "DialBackRequest"),
    ],
)
async def test_malformed_dial_backs_get_a_400_with_the_field(body, where, caplog):
    async with transports(TransportConfig(), TransportConfig()) as (boot, caller):
        with caplog.at_level(logging.WARNING, logger="dht.net.server"):
            with pytest.raises(RemoteError) as refused:
                await caller.call(boot.address, DIAL_BACK, body)
        assert refused.value.status == 400
        assert refused.value.reason.startswith(f"DialBackRequest.{where}") or where in (
            refused.value.reason
        )
        assert "refused POST /v2/rpc/dial_back" in caplog.text
        assert boot.dial_back.num_served == 0
        # and it serves on
        assert (await caller.call(boot.address, DIAL_BACK, {"port": 1}))["reachable"] is False


async def test_dial_backs_are_rate_limited_per_source_address():
    limited = ReachabilityConfig(max_dial_backs_per_s_per_address=0.01, dial_back_burst=2)
    config = TransportConfig(reachability=limited)
    async with transports(config, TransportConfig(), TransportConfig()) as (boot, a, b):
        for _ in range(2):
            await a.call(boot.address, DIAL_BACK, {"port": 1})
        # the same source IP, another peer id: the limit is per address, not per identity
        with pytest.raises(RemoteError) as refused:
            await b.call(boot.address, DIAL_BACK, {"port": 1})
        assert refused.value.status == 429 and "too many dial-backs" in refused.value.reason
        assert boot.dial_back.num_served == 2
        # a node refused by every peer asked cannot tell: it stays as configured
        reach = await check_reachability(b, [boot.address], FAST)
        assert reach.reachable is None and reach.address == b.address
        assert "none of the peers asked answered" in reachability_line(reach)


async def test_a_joiner_told_busy_asks_again_within_its_check_timeout():
    # many peers joining from one address at once (a demo on loopback, a shared NAT)
    busy = ReachabilityConfig(max_dial_backs_per_s_per_address=0.5, dial_back_burst=1)
    config = TransportConfig(reachability=busy)
    async with transports(config, TransportConfig(), TransportConfig()) as (boot, a, b):
        first, second = await asyncio.gather(
            check_reachability(a, [boot.address], FAST),
            check_reachability(b, [boot.address], FAST),
        )
        assert first.reachable is True and second.reachable is True
        assert boot.dial_back.num_served == 2 and boot.server.num_refused >= 1  # told 429


async def test_a_liar_saying_reachable_without_dialling_is_not_believed(caplog):
    async def lie(ctx, payload):
        return {"reachable": True, "observed_host": "127.0.0.1"}

    hidden = TransportConfig(host="127.0.0.2")
    async with transports(TransportConfig(), TransportConfig(), hidden) as (liar, honest, joiner):
        liar.add_rpc_handler(DIAL_BACK, lie)
        with caplog.at_level(logging.WARNING, logger="dht.reach.reachability"):
            reach = await check_reachability(joiner, [liar.address], FAST)
        assert reach.reachable is False and reach.num_answered == 1
        assert "never dialled in" in caplog.text
        # one proven positive is enough, whatever a liar says
        async with transports(TransportConfig(), TransportConfig()) as (boot, open_node):
            boot.add_rpc_handler(DIAL_BACK, lie)  # a liar that happens to tell the truth
            reach = await check_reachability(open_node, [boot.address, honest.address], FAST)
            assert reach.reachable is True and reach.num_confirmed == 1
            assert reach.num_answered == 2


async def test_with_no_peers_to_ask_it_stays_as_configured():
    async with transports(TransportConfig(), TransportConfig(client_mode=True)) as (first, client):
        reach = await settle_reachability(first, [], FAST)
        assert reach.reachable is None and first.address is not None
        assert reachability_line(reach) == (
            f"reachability unknown (no peers to ask): serving at {first.address}"
        )
        # its own address among the initial peers is no peer to ask either
        assert (await check_reachability(first, [first.address], FAST)).reachable is None
        reach = await settle_reachability(client, [first.address], FAST)
        assert reach.reachable is None and reach.address is None
        assert "client mode as configured" in reachability_line(reach)


async def test_a_wildcard_listener_announces_the_host_the_swarm_saw():
    async with transports(TransportConfig(), TransportConfig(host="0.0.0.0")) as (boot, joiner):
        reach = await settle_reachability(joiner, [boot.address], FAST)
        assert reach.reachable is True
        assert joiner.address == f"http://127.0.0.1:{port_of(reach.address)}" == reach.address


def test_paths_and_config_checks():
    assert path_of(None) == "client" and path_of("http://1.2.3.4:5") == "direct"
    assert path_of(f"http://10.0.0.1:9400/v2/relay/{'a' * 64}") == "relayed"
    with pytest.raises(ConfigError, match="check_timeout_s"):
        ReachabilityConfig(dial_back_timeout_s=5, check_timeout_s=5)
    with pytest.raises(ConfigError, match="dial_back_burst"):
        ReachabilityConfig(dial_back_burst=0)
    with pytest.raises(ConfigError, match="discovery_timeout_s"):
        PortMappingConfig(discovery_timeout_s=0)
    with pytest.raises(ConfigError, match="lease_s"):
        PortMappingConfig(lease_s=1)
    mapped = Reachability(reachable=True, address="http://1.2.3.4:5", port_mapped_by="UPnP")
    assert reachability_line(mapped) == "reachable at http://1.2.3.4:5 (port mapped by UPnP)"
    # peer join's --no-port-mapping reaches the transport's reachability config
    assert PeerConfig(port_mapping=False).transport_config().reachability.try_port_mapping is False
