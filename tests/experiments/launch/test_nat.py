"""Peers behind NAT in the netns launcher: each in its own home behind a masquerading router
namespace; it dials out (others see its router's address), nobody dials in. Links go through
the user-space emulator, so latency adds up along the path. Needs root, iproute2, nftables and
/dev/net/tun; CI runs as root."""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyroute2 import netns

from experiments.launch.base import ProcessPlan
from experiments.launch.netns import NetnsSession, address_of, list_namespaces
from experiments.launch.netns_links import LAN_PEER_ADDRESS
from experiments.spec import NetworkSpec

pytestmark = pytest.mark.timeout(120)

if os.geteuid() != 0 or shutil.which("nft") is None or not os.path.exists("/dev/net/tun"):
    pytestmark = [pytestmark, pytest.mark.skip(reason="needs root, nftables and /dev/net/tun")]

PORT = 9400


def _in(namespace: str, function: Callable[[], Any]) -> Any:
    """Run ``function`` in a thread moved into ``namespace``; return its result or raise."""
    out: list[Any] = []

    def target() -> None:
        try:
            netns.setns(namespace, flags=0)
            out.append(function())
        except BaseException as e:
            out.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _network() -> NetworkSpec:
    return NetworkSpec.model_validate(
        {"latency_ms": 5, "groups": [{"peers": [1], "nat": True, "latency_ms": 10}]}
    )


def test_a_peer_behind_nat_dials_out_as_its_router_and_nobody_dials_in(tmp_path: Path):
    prefix = f"vpx-n{os.getpid()}"
    with NetnsSession(tmp_path, prefix, 2, _network(), emulator="linkemu") as session:
        reachable, home = session.namespaces
        assert set(list_namespaces(prefix)) == {f"{prefix}-hub", reachable, home, f"{prefix}-r1"}
        listener = _in(reachable, lambda: socket.create_server((address_of(0), PORT)))
        with listener:
            listener.settimeout(10)
            dialled = _in(home, lambda: socket.create_connection((address_of(0), PORT), 10))
            conn, source = listener.accept()
            with conn, dialled:
                assert source[0] == address_of(1)  # masqueraded as the router's public address
                rtts = []
                for _ in range(30):
                    sent_s = time.monotonic()
                    dialled.sendall(b"x")
                    conn.recv(1)
                    conn.sendall(b"y")
                    dialled.recv(1)
                    rtts.append(time.monotonic() - sent_s)
        # two links, each way: 2 * (5 + 10) ms
        assert 0.030 <= statistics.median(rtts) <= 0.033 * 1.1
        inside = _in(home, lambda: socket.create_server((LAN_PEER_ADDRESS, PORT)))
        with inside:
            for target in (address_of(1), LAN_PEER_ADDRESS):
                with pytest.raises(OSError):
                    _in(reachable, lambda t=target: socket.create_connection((t, PORT), 2))
        assert session.listen_address(1) == LAN_PEER_ADDRESS
    assert list_namespaces(prefix) == []


def test_peers_behind_nat_listen_on_their_lan_address_and_find_client_mode_themselves(
    tmp_path: Path,
):
    prefix = f"vpx-m{os.getpid()}"
    with NetnsSession(tmp_path, prefix, 2, _network(), emulator="linkemu") as session:
        show = ["-c", "import sys; print(sys.argv)"]
        plans = [ProcessPlan(name=f"peer-{i}", args=show, index=i) for i in range(2)]
        plans.append(ProcessPlan(name="hm", args=[*show, "--backend", "hivemind"], index=1))
        handles = [session.start(plan) for plan in plans]
        for handle in handles:
            handle.process.wait(timeout=30)
        out = [(tmp_path / f"{plan.name}.out").read_text() for plan in plans]
    assert "--client-mode" not in out[0] and address_of(0) in out[0]
    # not forced: its own dial-back tells it (tests/experiments/launch/test_nat_swarm.py)
    assert "--client-mode" not in out[1] and LAN_PEER_ADDRESS in out[1]
    # the hivemind backend has no dial-back: it is told
    assert "--client-mode" in out[2] and LAN_PEER_ADDRESS in out[2]
