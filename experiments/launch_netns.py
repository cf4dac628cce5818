"""The ``netns`` launcher: each peer in its own Linux network namespace, links shaped by ``tc``.

Per configuration: a hub namespace ``<prefix>-hub`` holding a bridge (``br0``, 10.213.0.1/16,
where the bootstrap node listens) and one namespace ``<prefix>-p<i>`` per peer, joined to the
bridge by a veth pair (``eth0`` in the peer, ``v<i>`` in the hub; 10.213.x.y). Nothing is added
to the host's own network. Each peer's link is shaped in both directions as its spec says: a
``netem`` qdisc (delay, jitter, loss) with a ``tbf`` rate limiter under it, on the peer's
``eth0`` (upload) and the hub's ``v<i>`` (download). The baseline runs outside any namespace.

Cleanup is always done: closing a session kills what runs in its namespaces and deletes them
(the veths go with them); the launcher also starts a guard process that deletes the sweep's
namespaces if this process dies without cleaning up (SIGKILL); ``peer experiment cleanup``
deletes every namespace whose name starts with :data:`PREFIX`. Needs root, ``ip`` and ``tc``.

The host has no route into the emulated network; a sweep's dashboard reaches the swarm by moving
its own thread into the hub namespace (:meth:`NetnsSession.network_entry`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from experiments.launch_base import (
    Launcher,
    LaunchError,
    PopenHandle,
    ProcessPlan,
    Session,
    pinned,
    python,
)
from experiments.spec import LinkSpec, NetworkSpec

PREFIX = "vpx-"
HUB_ADDRESS = "10.213.0.1"
PREFIX_LEN = 16
COMMAND_TIMEOUT_S = 20.0
# Bytes the rate limiter may send at once: 10 ms at the link's rate, at least 32 KiB.
MIN_BURST_BYTES = 32 * 1024
CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``.

    Raises:
        LaunchError: it failed (with ``check``); the message holds its stderr.
    """
    return _run(["ip", *args], check=check)


def _run(command: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise LaunchError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done


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


def shaping_commands(device: str, link: LinkSpec) -> list[list[str]]:
    """``tc`` arguments that shape egress of ``device`` as ``link`` says."""
    commands, parent = [], ["root"]
    if link.needs_netem:
        netem = ["netem", "limit", "10000"]
        if link.latency_ms or link.jitter_ms:
            netem += ["delay", f"{link.latency_ms}ms"]
            if link.jitter_ms:
                netem += [f"{link.jitter_ms}ms", "distribution", "normal"]
        if link.loss_percent:
            netem += ["loss", f"{link.loss_percent}%"]
        commands.append(["qdisc", "add", "dev", device, "root", "handle", "1:", *netem])
        parent = ["parent", "1:"]
    if link.bandwidth_mbit is not None:
        burst = max(MIN_BURST_BYTES, int(link.bandwidth_mbit * 1e6 / 8 / 100))
        tbf = ["tbf", "rate", f"{link.bandwidth_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        commands.append(["qdisc", "add", "dev", device, *parent, "handle", "2:", *tbf])
    return commands


class NetnsSession(Session):
    """One configuration's namespaces; see the module docstring."""

    def __init__(self, run_dir: Path, prefix: str, num_peers: int, network: NetworkSpec):
        super().__init__(run_dir)
        self.hub = f"{prefix}-hub"
        self.namespaces = [f"{prefix}-p{index}" for index in range(num_peers)]
        self._closed = False
        if num_peers:
            try:
                self._build(network)
            except BaseException:
                self.close()
                raise

    def _build(self, network: NetworkSpec) -> None:
        ip("netns", "add", self.hub)
        hub = ["-n", self.hub]
        ip(*hub, "link", "set", "lo", "up")
        ip(*hub, "link", "add", "br0", "type", "bridge")
        ip(*hub, "addr", "add", f"{HUB_ADDRESS}/16", "dev", "br0")
        ip(*hub, "link", "set", "br0", "up")
        for index, name in enumerate(self.namespaces):
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
            veth = ["type", "veth", "peer", "name", "eth0", "netns", name]
            ip(*hub, "link", "add", f"v{index}", *veth)
            ip(*hub, "link", "set", f"v{index}", "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{address_of(index)}/16", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            link = network.link_for(index)
            for args in shaping_commands("eth0", link):
                _run(["ip", "netns", "exec", name, "tc", *args])
            for args in shaping_commands(f"v{index}", link):
                _run(["ip", "netns", "exec", self.hub, "tc", *args])

    def network_entry(self) -> Callable[[], None] | None:
        """Into the hub namespace, where the bootstrap listens and every peer is on the bridge
        (the host has no route there: its own network is left alone)."""
        return functools.partial(enter_namespace, self.hub) if self.namespaces else None

    def namespace_of(self, plan: ProcessPlan) -> str | None:
        if plan.index is not None:
            return self.namespaces[plan.index]
        return self.hub if plan.listens else None

    def start(self, plan: ProcessPlan) -> PopenHandle:
        namespace = self.namespace_of(plan)
        command = [python(), *plan.args]
        if plan.listens:
            host = HUB_ADDRESS if plan.index is None else address_of(plan.index)
            command += ["--host", host]
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
            for name in [*self.namespaces, self.hub]:
                delete_namespace(name)


class NetnsLauncher(Launcher):
    """See the module docstring."""

    name = "netns"

    def __init__(self, network: NetworkSpec):
        self.network = network
        self.prefix = PREFIX + secrets.token_hex(3)
        self._guard: subprocess.Popen | None = None

    def check(self) -> None:
        if os.geteuid() != 0:
            raise LaunchError("the netns launcher needs root (network namespaces and tc)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LaunchError(f"the netns launcher needs `{tool}` (install iproute2)")
        if self.network.needs_netem and not netem_available():
            raise LaunchError(
                "network: latency, jitter and loss need the kernel's sch_netem module, which "
                "this machine lacks (modprobe sch_netem); bandwidth alone can be shaped"
            )

    def open_session(self, run_dir: Path, num_peers: int) -> NetnsSession:
        if self._guard is None:
            self._guard = subprocess.Popen(
                [python(), "-m", "experiments.netns_guard", self.prefix, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives a SIGKILL of this process group
            )
        return NetnsSession(run_dir, self.prefix, num_peers, self.network)

    def close(self) -> None:
        cleanup_all(self.prefix)
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.terminate()
            guard.wait(timeout=COMMAND_TIMEOUT_S)


def netem_available() -> bool:
    """Whether a netem qdisc can be created (probed in a throwaway namespace)."""
    probe = f"{PREFIX}probe-{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
        done = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                     "netem", "delay", "1ms"], check=False)  # fmt: skip
        return done.returncode == 0
    except LaunchError:
        return False
    finally:
        delete_namespace(probe)
