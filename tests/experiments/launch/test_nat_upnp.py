"""A peer behind a home router that speaks UPnP-IGD (a real miniupnpd in the router namespace)
maps its port, is dialled back through the mapping and is called directly by peers outside; with
no gateway it is relayed as before. Needs root, iproute2, nftables and miniupnpd
(miniupnpd-nftables); CI runs as root and installs them."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from dht.config import DHTConfig
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.launch import open_node
from dht.net.config import PortMappingConfig, ReachabilityConfig, TransportConfig
from dht.reach.reachability import reachability_line
from experiments.launch.netns import cleanup_all, list_namespaces
from experiments.launch.netns_links import LAN_PEER_ADDRESS, home_router, in_namespace, ip
from peer.run.flags import join_command
from tests.experiments.launch.namespace_loop import LoopInNamespace
from tests.experiments.launch.test_nat import _in

MINIUPNPD = "/usr/sbin/miniupnpd"
pytestmark = pytest.mark.timeout(120)
if os.geteuid() != 0 or shutil.which("nft") is None or not os.path.exists(MINIUPNPD):
    pytestmark = [pytestmark, pytest.mark.skip(reason="needs root, nftables and miniupnpd")]

# The router's uplink must look public: miniupnpd maps no port on a private/reserved address.
# Nothing leaves these namespaces, so any routable-looking prefix will do.
OUTSIDE_ADDRESS, ROUTER_ADDRESS = "11.0.0.1", "11.0.0.2"
PORT = 9401
NAT_CHAIN = "prerouting_miniupnpd"  # where miniupnpd puts its DNAT rules
FAST = ReachabilityConfig(
    dial_back_timeout_s=2.0,
    check_timeout_s=6.0,
    port_mapping=PortMappingConfig(discovery_timeout_s=2.0, lease_s=600),
)
# What miniupnpd needs in nftables (as its nft_init.sh makes them), with the forward chain's
# policy "accept": the home router's own table keeps filtering. Its forward chain lets in what
# a port mapping redirected (ct status dnat), as a home router does for its port forwards.
UPNP_TABLES = """
table inet filter {
    chain forward {
        type filter hook forward priority 0; policy accept;
        jump miniupnpd
    }
    chain miniupnpd {
    }
    chain prerouting {
        type nat hook prerouting priority -100; policy accept;
        jump prerouting_miniupnpd
    }
    chain postrouting {
        type nat hook postrouting priority 100; policy accept;
        jump postrouting_miniupnpd
    }
    chain prerouting_miniupnpd {
    }
    chain postrouting_miniupnpd {
    }
}
"""
FORWARD_MAPPED = "add rule ip home forward ct status dnat accept"
MINIUPNPD_CONF = """
ext_ifname=wan0
listening_ip=lan0
port=0
enable_upnp=yes
enable_natpmp=no
secure_mode=yes
uuid=3d3cec3a-8cf0-11e0-98ee-001a6bd2d07b
lease_file={lease_file}
{rules}allow 1024-65535 192.168.1.0/24 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
"""


@contextmanager
def home_network(
    tmp_path: Path,
    prefix: str,
    *,
    upnp: bool,
    refused_port: int | None = None,
    forwards_mapped: bool = True,
) -> Iterator[tuple[str, str, str]]:
    """Namespaces (outside, router, home): the home peer behind a masquerading router whose
    uplink faces the outside namespace directly; with ``upnp``, miniupnpd runs on the router
    (and maps no external ``refused_port``, as if another host of the LAN held it); without
    ``forwards_mapped`` the router's firewall drops what its mappings redirect."""
    outside, router, home = f"{prefix}-o", f"{prefix}-r", f"{prefix}-h"
    guard = subprocess.Popen(
        [sys.executable, "-m", "experiments.launch.netns_guard", prefix, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # outlives a SIGKILL of this process group
    )
    try:
        for name in (outside, router, home):
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip(
            "-n",
            outside,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "wan0",
            "netns",
            router,
        )
        for name, device, address in (
            (outside, "eth0", OUTSIDE_ADDRESS),
            (router, "wan0", ROUTER_ADDRESS),
        ):
            ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            ip("-n", name, "link", "set", device, "up")
        home_router(router, home)
        if upnp:
            tables = UPNP_TABLES + (FORWARD_MAPPED if forwards_mapped else "")
            in_namespace(router, "nft", "-f", "-", stdin=tables)
            config = tmp_path / "miniupnpd.conf"
            rules = f"deny {refused_port} 0.0.0.0/0 0-65535\n" if refused_port else ""
            leases = tmp_path / "miniupnpd.leases"
            config.write_text(MINIUPNPD_CONF.format(lease_file=leases, rules=rules))
            log = (tmp_path / "miniupnpd.log").open("w")
            # -d: in the foreground, logging to stderr; the namespace's deletion kills it
            command = ["ip", "netns", "exec", router, MINIUPNPD, "-d", "-f", str(config)]
            command += ["-P", str(tmp_path / "miniupnpd.pid")]
            subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            _wait_for(tmp_path / "miniupnpd.log", "HTTP listening on port")
        yield outside, router, home
    finally:
        cleanup_all(prefix)
        guard.send_signal(signal.SIGTERM)
        guard.wait(timeout=30)


def _wait_for(log: Path, line: str, timeout_s: float = 20, count: int = 1) -> None:
    deadline_s = time.monotonic() + timeout_s
    while log.read_text().count(line) < count:
        if time.monotonic() > deadline_s:
            raise AssertionError(f"no {line!r} in {log.name}: {log.read_text()[-3000:]}")
        time.sleep(0.1)


class NodeInNamespace(LoopInNamespace):
    """An ``open_node`` on its own event loop, in a thread inside ``namespace``, until stopped;
    :meth:`start` returns the node."""

    def __init__(
        self,
        namespace: str,
        host: str,
        port: int,
        peers: tuple[str, ...] = (),
        reachability: ReachabilityConfig = FAST,
        **kw: Any,
    ):
        super().__init__(namespace)
        self._host, self._port, self._kw = host, port, kw
        self._reachability = reachability
        self._initial_peers = peers
        self.node: DHTNode | None = None

    def start(self, timeout_s: float = 60) -> DHTNode:
        return super().start(timeout_s)

    def run(self, function: Callable[[DHTNode], Awaitable[Any]], timeout_s: float = 30) -> Any:
        """``await function(node)`` on the node's loop; its result."""
        return self.call(lambda: function(self.node), timeout_s)

    async def serve(self) -> None:
        transport = TransportConfig(
            host=self._host, port=self._port, reachability=self._reachability
        )
        dht = DHTConfig(initial_peers=self._initial_peers)
        async with open_node(PeerIdentity.generate(), transport, dht, **self._kw) as node:
            self.node = node
            self.started(node)
            await self.stopped()


def _dnat_rules(router: str) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", router, "nft", "list", "chain", "inet", "filter", NAT_CHAIN],
        capture_output=True, text=True, timeout=20, check=True,
    )  # fmt: skip
    return done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("port_taken", "host"),
    [(False, "0.0.0.0"), (True, LAN_PEER_ADDRESS)],
    ids=["same-port-wildcard", "port-taken-lan-address"],
)
def test_a_peer_behind_a_upnp_router_maps_its_port_and_is_called_directly(
    tmp_path: Path, port_taken: bool, host: str
):
    prefix = f"vpx-u{os.getpid()}"
    refused = PORT if port_taken else None
    with home_network(tmp_path, prefix, upnp=True, refused_port=refused) as (outside, router, home):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        boot_node = boot.start()
        peers = (boot_node.transport.address,)
        joiner = NodeInNamespace(home, host, PORT, peers, check_reachability=True)
        caller = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0, peers)
        try:
            node = joiner.start()
            reach = node.transport.reachability
            url = urlsplit(reach.address)
            assert (reach.reachable, reach.path, reach.port_mapped_by) == (True, "direct", "UPnP")
            assert url.hostname == ROUTER_ADDRESS  # the router's public address, the mapped port
            assert (url.port != PORT) == port_taken  # taken: another external port, announced
            assert reachability_line(reach) == f"reachable at {reach.address} (port mapped by UPnP)"
            assert f"dnat ip to {LAN_PEER_ADDRESS}:{PORT}" in _dnat_rules(router)
            assert f"dport {url.port} " in _dnat_rules(router)
            # another peer outside calls it at that address: no relay in between
            caller.start()
            answer = caller.run(lambda n: n.protocol.ping(reach.address))
            assert answer is not None and answer.peer_id == node.transport.peer_id
            assert not node.transport.relayed
        finally:
            joiner.stop()
            caller.stop()
            boot.stop()
        assert LAN_PEER_ADDRESS not in _dnat_rules(router)  # deleted when the peer closed
    assert list_namespaces(prefix) == []


@pytest.mark.timeout(60)
def test_the_library_dht_behind_a_upnp_router_maps_its_port_and_deletes_it_at_shutdown(
    tmp_path: Path,
):
    import peer  # the library's peer.DHT, as a user's script makes it

    prefix = f"vpx-l{os.getpid()}"
    with home_network(tmp_path, prefix, upnp=True) as (outside, router, home):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        peers = [boot.start().transport.address]
        try:
            # its threads are made in the home namespace, so they live there
            dht = _in(home, lambda: peer.DHT(peers, host="0.0.0.0", port=PORT))
            try:
                reach = dht.reachability
                assert (reach.reachable, reach.path, reach.port_mapped_by) == (
                    True,
                    "direct",
                    "UPnP",
                )
                assert dht.urls == [f"http://{ROUTER_ADDRESS}:{PORT}"]
                assert f"dnat ip to {LAN_PEER_ADDRESS}:{PORT}" in _dnat_rules(router)
            finally:
                dht.shutdown()
            assert LAN_PEER_ADDRESS not in _dnat_rules(router)
        finally:
            boot.stop()


@pytest.mark.timeout(180)
def test_peer_join_behind_a_upnp_router_says_so_and_deletes_the_mapping_when_stopped(
    tmp_path: Path,
):
    prefix = f"vpx-j{os.getpid()}"
    with home_network(tmp_path, prefix, upnp=True) as (outside, router, home):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        url = boot.start().transport.address
        args = join_command(
            log_level="INFO",
            run_id="upnp",
            task="synthetic",
            task_option=["hidden_dim=16", "input_dim=16", "num_eval_batches=0"],
            torch_threads=1,
            host="0.0.0.0",
            port=PORT,
            initial_peers=[url],
            checkpoint_dir=str(tmp_path / "checkpoints"),
        )
        log = tmp_path / "peer.out"
        env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
        with log.open("w") as out:
            command = ["ip", "netns", "exec", home, sys.executable, *args]
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            line = f"reachable at http://{ROUTER_ADDRESS}:{PORT} (port mapped by UPnP)"
            _wait_for(log, line, timeout_s=150)
            assert f"dnat ip to {LAN_PEER_ADDRESS}:{PORT}" in _dnat_rules(router)
            process.send_signal(signal.SIGTERM)  # the peer's own graceful stop
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()
            boot.stop()
        assert LAN_PEER_ADDRESS not in _dnat_rules(router)


@pytest.mark.timeout(60)
def test_a_mapping_nobody_can_dial_is_deleted_and_the_peer_is_relayed(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="dht")
    prefix = f"vpx-w{os.getpid()}"
    with home_network(tmp_path, prefix, upnp=True, forwards_mapped=False) as (
        outside,
        router,
        home,
    ):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        peers = (boot.start().transport.address,)
        joiner = NodeInNamespace(home, LAN_PEER_ADDRESS, PORT, peers, check_reachability=True)
        try:
            reach = joiner.start().transport.reachability
            assert (reach.reachable, reach.path, reach.port_mapped_by) == (False, "relayed", None)
            assert LAN_PEER_ADDRESS not in _dnat_rules(router)  # deleted at once, not kept
        finally:
            joiner.stop()
            boot.stop()
    assert "yet no peer could dial it" in caplog.text
    assert "deleted the port mapping 11.0.0.2:9401 -> 192.168.1.2:9401" in caplog.text


@pytest.mark.timeout(60)
def test_a_kept_mapping_is_renewed_before_its_lease_ends(tmp_path: Path):
    prefix = f"vpx-y{os.getpid()}"
    lease_s = 4
    short = dataclasses.replace(FAST, port_mapping=PortMappingConfig(lease_s=lease_s))
    with home_network(tmp_path, prefix, upnp=True) as (outside, router, home):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        peers = (boot.start().transport.address,)
        joiner = NodeInNamespace(
            home, LAN_PEER_ADDRESS, PORT, peers, short, check_reachability=True
        )
        try:
            assert joiner.start().transport.reachability.port_mapped_by == "UPnP"
            # renewed every lease_s / 2: after three renewals the first lease is long over
            log = tmp_path / "miniupnpd.log"
            _wait_for(log, "updating existing port mapping", timeout_s=40, count=3)
            assert f"dnat ip to {LAN_PEER_ADDRESS}:{PORT}" in _dnat_rules(router)
        finally:
            joiner.stop()
            boot.stop()


@pytest.mark.timeout(60)
def test_a_peer_that_opted_out_maps_nothing(tmp_path: Path):
    prefix = f"vpx-x{os.getpid()}"
    with home_network(tmp_path, prefix, upnp=True) as (outside, router, home):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        peers = (boot.start().transport.address,)
        config = dataclasses.replace(FAST, try_port_mapping=False)
        joiner = NodeInNamespace(
            home, LAN_PEER_ADDRESS, PORT, peers, config, check_reachability=True
        )
        try:
            reach = joiner.start().transport.reachability
            assert (reach.reachable, reach.path, reach.port_mapped_by) == (False, "relayed", None)
            assert LAN_PEER_ADDRESS not in _dnat_rules(router)
        finally:
            joiner.stop()
            boot.stop()
    assert "redirecting port" not in (tmp_path / "miniupnpd.log").read_text()  # never asked


@pytest.mark.timeout(60)
def test_with_no_gateway_a_peer_behind_nat_is_relayed_as_before(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="dht.reach.port_mapping")
    prefix = f"vpx-v{os.getpid()}"
    with home_network(tmp_path, prefix, upnp=False) as (outside, _router, home):
        boot = NodeInNamespace(outside, OUTSIDE_ADDRESS, 0)
        peers = (boot.start().transport.address,)
        joiner = NodeInNamespace(home, LAN_PEER_ADDRESS, PORT, peers, check_reachability=True)
        try:
            reach = joiner.start().transport.reachability
            assert (reach.reachable, reach.path, reach.port_mapped_by) == (False, "relayed", None)
            assert reach.address.startswith(f"{peers[0]}/v2/relay/")
        finally:
            joiner.stop()
            boot.stop()
    assert "no UPnP gateway answered within 2.0 s" in caplog.text
