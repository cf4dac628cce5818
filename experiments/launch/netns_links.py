"""The netns launcher's links: a peer's (or its home router's) uplink to the hub, and NAT.

A link joins device ``wan_if`` in namespace ``wan_ns`` to device ``v<i>`` in the hub and is
shaped as its :class:`~experiments.spec.LinkSpec` says, in both directions, by one of two
emulators:

- ``tc``: a veth pair, with a ``netem`` qdisc (delay, jitter, loss) over a ``tbf`` rate limiter
  on each end's egress. Precise and cheap, but latency, jitter and loss need the kernel's
  ``sch_netem``.
- ``linkemu``: a pair of TAP devices and a user-space forwarder (:mod:`experiments.linkemu`),
  for kernels without ``sch_netem``; costs CPU (see docs/EXPERIMENTS.md).

A peer behind NAT (``nat = true``) sits in its own home: namespace ``<prefix>-r<i>`` is its router,
holding the shaped uplink (``wan0``, the peer's public address) and a LAN veth (``lan0``,
192.168.1.1/24) to the peer's ``eth0`` (192.168.1.2/24, default route via the router). nftables
masquerades what leaves ``wan0`` and forwards inward only what belongs to connections the LAN
opened, as a home router does: the peer can dial out; nobody can dial in.
"""

from __future__ import annotations

import subprocess

from experiments.launch.base import LaunchError
from experiments.spec import LinkSpec

COMMAND_TIMEOUT_S = 20.0
# Bytes the rate limiter may send at once: 10 ms at the link's rate, at least 32 KiB.
MIN_BURST_BYTES = 32 * 1024
LAN_ROUTER_ADDRESS = "192.168.1.1"
LAN_PEER_ADDRESS = "192.168.1.2"
LAN_PREFIX_LEN = 24
# A home router: masquerade outward; inward, only replies to what the LAN opened.
HOME_ROUTER_RULES = """
table ip home {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" accept
    }
}
"""


def run_command(
    command: list[str], *, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``command`` (text in and out).

    Raises:
        LaunchError: it failed (with ``check``); the message holds its stderr.
    """
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
        input=stdin,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise LaunchError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``.

    Raises:
        LaunchError: it failed (with ``check``); the message holds its stderr.
    """
    return run_command(["ip", *args], check=check)


def in_namespace(name: str, *command: str, stdin: str | None = None) -> None:
    """Run ``command`` inside namespace ``name``.

    Raises:
        LaunchError: it failed.
    """
    run_command(["ip", "netns", "exec", name, *command], stdin=stdin)


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


def veth_link(hub: str, hub_if: str, wan_ns: str, wan_if: str, link: LinkSpec) -> None:
    """A veth pair between ``hub:hub_if`` and ``wan_ns:wan_if``, shaped with ``tc``."""
    ip("-n", hub, "link", "add", hub_if, "type", "veth", "peer", "name", wan_if, "netns", wan_ns)
    for args in shaping_commands(wan_if, link):
        in_namespace(wan_ns, "tc", *args)
    for args in shaping_commands(hub_if, link):
        in_namespace(hub, "tc", *args)


def home_router(router: str, peer: str) -> None:
    """Make ``router`` (already holding its uplink ``wan0``) the NAT router of ``peer``."""
    ip("-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", peer)
    ip("-n", router, "addr", "add", f"{LAN_ROUTER_ADDRESS}/{LAN_PREFIX_LEN}", "dev", "lan0")
    ip("-n", router, "link", "set", "lan0", "up")
    ip("-n", peer, "addr", "add", f"{LAN_PEER_ADDRESS}/{LAN_PREFIX_LEN}", "dev", "eth0")
    ip("-n", peer, "link", "set", "eth0", "up")
    ip("-n", peer, "route", "add", "default", "via", LAN_ROUTER_ADDRESS)
    in_namespace(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    in_namespace(router, "nft", "-f", "-", stdin=HOME_ROUTER_RULES)
