"""The ``netns`` launcher: each peer in its own Linux network namespace, links shaped by ``tc``.

Per configuration: a hub namespace ``<prefix>-hub`` holding a bridge (``br0``, 10.213.0.1/16,
where the bootstrap node listens) and one namespace ``<prefix>-p<i>`` per peer, joined to the
bridge by a veth pair (``eth0`` in the peer, ``v<i>`` in the hub; 10.213.x.y). Nothing is added
to the host's own network. Each peer's link is shaped in both directions as its spec says, by
kernel qdiscs (``tc``: netem + tbf) or, where the kernel lacks ``sch_netem``, by the user-space
link emulator (:mod:`experiments.linkemu`); a peer with ``nat = true`` sits behind a home router
namespace ``<prefix>-r<i>``, where the dial-back of its bootstrap finds it unreachable and it
turns to client mode by itself. See :mod:`experiments.launch.netns_links`. The
baseline runs outside any namespace.

Cleanup is always done: closing a session kills what runs in its namespaces and deletes them
(the veths go with them); the launcher also starts a guard process that deletes the sweep's
namespaces if this process dies without cleaning up (SIGKILL); ``peer experiment cleanup``
deletes every namespace whose name starts with :data:`PREFIX`; link forwarders exit when the
launcher does. Needs root, ``ip`` and ``tc`` (and ``nft`` for NAT).

The host has no route into the emulated network; a sweep's dashboard reaches the swarm by moving
its own thread into the hub namespace (:meth:`NetnsSession.network_entry`).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from experiments.launch.base import (
    Launcher,
    LaunchError,
    PopenHandle,
    ProcessPlan,
    Session,
    pinned,
    python,
)
from experiments.launch.netns_links import (
    LAN_PEER_ADDRESS,
    home_router,
    ip,
    run_command,
    shaping_commands,
    veth_link,
)
from experiments.spec import NetworkSpec

if TYPE_CHECKING:
    from experiments.linkemu.emulator import EmulatedLink

__all__ = ["NetnsLauncher", "NetnsSession", "ip", "shaping_commands"]

PREFIX = "vpx-"
HUB_ADDRESS = "10.213.0.1"
PREFIX_LEN = 16
COMMAND_TIMEOUT_S = 20.0
CLONE_NEWNET = 0x40000000


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces starting with ``prefix``."""
    listed = ip("netns", "list", check=False).stdout.splitlines()
    names = [line.split()[0] for line in listed if line.strip()]
    return sorted(name for name in names if name.startswith(prefix))


def delete_namespace(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it (its veths go with it)."""
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", name, check=False)


def cleanup_all(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace starting with ``prefix``; returns their names."""
    names = list_namespaces(prefix)
    for name in names:
        delete_namespace(name)
    return names


def enter_namespace(name: str) -> None:
    """Move the calling thread (only it) into network namespace ``name``; sockets it opens
    afterwards live there. Needs root.

    Raises:
        OSError: the namespace does not exist or setns(2) refused.
    """
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def address_of(index: int) -> str:
    """Peer ``index``'s address on the emulated network."""
    host = index + 2
    return f"10.213.{host // 256}.{host % 256}"


class NetnsSession(Session):
    """One configuration's namespaces; see the module docstring."""

    def __init__(
        self,
        run_dir: Path,
        prefix: str,
        num_peers: int,
        network: NetworkSpec,
        *,
        emulator: Literal["tc", "linkemu"] = "tc",
    ):
        super().__init__(run_dir)
        self.hub = f"{prefix}-hub"
        self.namespaces = [f"{prefix}-p{index}" for index in range(num_peers)]
        self.routers = {
            index: f"{prefix}-r{index}" for index in range(num_peers) if network.behind_nat(index)
        }
        self.emulator = emulator
        self.links: list[EmulatedLink] = []
        self._closed = False
        if num_peers:
            try:
                self._build(network)
            except BaseException:
                self.close()
                raise

    def _build(self, network: NetworkSpec) -> None:
        self._add_namespace(self.hub)
        hub = ["-n", self.hub]
        ip(*hub, "link", "add", "br0", "type", "bridge")
        ip(*hub, "addr", "add", f"{HUB_ADDRESS}/{PREFIX_LEN}", "dev", "br0")
        ip(*hub, "link", "set", "br0", "up")
        for index, name in enumerate(self.namespaces):
            self._add_namespace(name)
            if network.tcp_congestion:  # a per-namespace setting: the host keeps its own
                ip(
                    "netns",
                    "exec",
                    name,
                    "sysctl",
                    "-qw",
                    f"net.ipv4.tcp_congestion_control={network.tcp_congestion}",
                )
            router = self.routers.get(index)
            if router is not None:
                self._add_namespace(router)
            wan_ns, wan_if = (router, "wan0") if router else (name, "eth0")
            self._uplink(index, wan_ns, wan_if, network)
            ip(*hub, "link", "set", f"v{index}", "master", "br0", "up")
            ip("-n", wan_ns, "addr", "add", f"{address_of(index)}/{PREFIX_LEN}", "dev", wan_if)
            ip("-n", wan_ns, "link", "set", wan_if, "up")
            if router is not None:
                home_router(router, name)

    @staticmethod
    def _add_namespace(name: str) -> None:
        ip("netns", "add", name)
        ip("-n", name, "link", "set", "lo", "up")

    def _uplink(self, index: int, wan_ns: str, wan_if: str, network: NetworkSpec) -> None:
        link = network.link_for(index)
        if self.emulator == "tc" or not link.shaped:
            veth_link(self.hub, f"v{index}", wan_ns, wan_if, link)
            return
        from experiments.linkemu.emulator import EmulatedLink, Endpoint, shape_from

        shape = shape_from(**link.model_dump())
        self.links.append(
            EmulatedLink(
                Endpoint(ifname=wan_if, netns=wan_ns),
                Endpoint(ifname=f"v{index}", netns=self.hub),
                a_to_b=shape,
                b_to_a=shape,
                log_file=self.run_dir / f"linkemu-{index}.log",
            )
        )

    def network_entry(self) -> Callable[[], None] | None:
        """Into the hub namespace, where the bootstrap listens and every peer is on the bridge
        (the host has no route there: its own network is left alone)."""
        return functools.partial(enter_namespace, self.hub) if self.namespaces else None

    def listen_address(self, index: int | None) -> str:
        """Where the peer ``index`` (None: the bootstrap node) listens."""
        if index is None:
            return HUB_ADDRESS
        return LAN_PEER_ADDRESS if index in self.routers else address_of(index)

    def namespace_of(self, plan: ProcessPlan) -> str | None:
        if plan.index is not None:
            return self.namespaces[plan.index]
        return self.hub if plan.listens else None

    def start(self, plan: ProcessPlan) -> PopenHandle:
        namespace = self.namespace_of(plan)
        command = [python(), *plan.args]
        if plan.listens:
            # behind a NAT a native peer finds by itself that nobody can dial it (dial-back);
            # the hivemind backend has no such check: it is told
            command += ["--host", self.listen_address(plan.index)]
            if plan.index in self.routers and _runs_hivemind(plan.args):
                command.append("--client-mode")
        if plan.metrics:
            command += ["--metrics-file", str(self.run_dir / f"{plan.name}.jsonl")]
        command = pinned(command, plan.cpus)
        if namespace is not None:
            command = ["ip", "netns", "exec", namespace, *command]
        handle = PopenHandle(plan.name, command, self.run_dir, os.environ | plan.env)
        self.handles.append(handle)
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.stop_all(grace_s=5.0)
        finally:
            for link in self.links:
                link.close()
            for name in [*self.namespaces, *self.routers.values(), self.hub]:
                delete_namespace(name)


def _runs_hivemind(args: list[str]) -> bool:
    return any(a == "--backend" and b == "hivemind" for a, b in itertools.pairwise(args))


class NetnsLauncher(Launcher):
    """See the module docstring."""

    name = "netns"

    def __init__(self, network: NetworkSpec):
        self.network = network
        self.prefix = PREFIX + secrets.token_hex(3)
        self.emulator: Literal["tc", "linkemu"] = "tc"
        self._guard: subprocess.Popen | None = None
        self._allowed_before: list[str] | None = None

    def check(self) -> None:
        if os.geteuid() != 0:
            raise LaunchError("the netns launcher needs root (network namespaces and tc)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LaunchError(f"the netns launcher needs `{tool}` (install iproute2)")
        if any(group.nat for group in self.network.groups) and shutil.which("nft") is None:
            raise LaunchError("network.groups: nat = true needs `nft` (install nftables)")
        self._allow_congestion_control()
        self.emulator = self._choose_emulator()

    def _allow_congestion_control(self) -> None:
        """Make ``network.tcp_congestion`` one a namespace may take as its default.

        Outside the host's own namespace the kernel lets a namespace default only to the
        controls in the host's ``tcp_allowed_congestion_control``: add it there for the run
        (:meth:`close` puts the list back).
        """
        wanted = self.network.tcp_congestion
        if not wanted:
            return
        if wanted not in available_congestion_controls():
            raise LaunchError(
                f"network.tcp_congestion: {wanted} is not available here (have: "
                f"{', '.join(available_congestion_controls())}; modprobe tcp_{wanted})"
            )
        allowed = _ALLOWED_CONGESTION.read_text().split()
        if wanted not in allowed:
            allow_congestion_controls([*allowed, wanted])
            self._allowed_before = allowed

    def _choose_emulator(self) -> Literal["tc", "linkemu"]:
        from experiments.linkemu.emulator import available as linkemu_available

        choice = self.network.emulator
        if choice == "auto":
            if not self.network.needs_netem or netem_available():
                return "tc"
            choice = "linkemu"
        if choice == "tc" and self.network.needs_netem and not netem_available():
            raise LaunchError(
                "network: latency, jitter and loss need the kernel's sch_netem module, which "
                "this machine lacks (modprobe sch_netem); emulator = 'auto' or 'linkemu' "
                "emulates them in user space"
            )
        if choice == "linkemu" and not linkemu_available():
            raise LaunchError("network.emulator: linkemu needs root and /dev/net/tun")
        return choice

    def open_session(self, run_dir: Path, num_peers: int) -> NetnsSession:
        if self._guard is None:
            restore = [",".join(self._allowed_before)] if self._allowed_before else []
            self._guard = subprocess.Popen(
                [
                    python(),
                    "-m",
                    "experiments.launch.netns_guard",
                    self.prefix,
                    str(os.getpid()),
                    *restore,
                ],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives a SIGKILL of this process group
            )
        return NetnsSession(run_dir, self.prefix, num_peers, self.network, emulator=self.emulator)

    def close(self) -> None:
        if shutil.which("ip") is not None:  # a check that found no `ip` made no namespace
            cleanup_all(self.prefix)
        allowed, self._allowed_before = self._allowed_before, None
        if allowed is not None:
            allow_congestion_controls(allowed)
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.terminate()
            guard.wait(timeout=COMMAND_TIMEOUT_S)


def available_congestion_controls() -> list[str]:
    """The TCP congestion controls this kernel has loaded."""
    path = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    return path.read_text().split() if path.exists() else []


_ALLOWED_CONGESTION = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def allow_congestion_controls(names: list[str]) -> None:
    """Set the host's ``tcp_allowed_congestion_control`` (those a namespace may default to)."""
    _ALLOWED_CONGESTION.write_text(" ".join(names))


def netem_available() -> bool:
    """Whether a netem qdisc can be created (probed in a throwaway namespace)."""
    probe = f"{PREFIX}probe-{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
        done = run_command(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                     "netem", "delay", "1ms"], check=False)  # fmt: skip
        return done.returncode == 0
    except LaunchError:
        return False
    finally:
        delete_namespace(probe)
