"""Measuring what the emulator does: RTT, one TCP flow's throughput, loss, and its CPU cost.

:class:`EmulatedPair` joins two fresh namespaces by one emulated link; the ``measure_*``
functions run a client in one and a server in the other (threads of this process, each moved
into its namespace) and return what they saw. ``python -m experiments.linkemu.fidelity`` prints
all of them as JSON for a given link (needs root), which is how docs/EXPERIMENTS.md's numbers
were taken; tests/experiments/linkemu/test_linkemu.py checks them against the configured values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyroute2 import netns

from experiments.launch.netns import PREFIX, delete_namespace, ip
from experiments.linkemu.emulator import EmulatedLink, Endpoint, shape_from
from experiments.linkemu.shaper import LinkShape

ADDRESS_A, ADDRESS_B = "10.214.0.1", "10.214.0.2"
PORT = 9300
# Seconds any one socket operation of a measurement may wait (a lost reply, a stuck peer).
SOCKET_TIMEOUT_S = 5.0
CHUNK_BYTES = 64 * 1024
# Seconds a ping waits for its echo before counting it lost.
PING_TIMEOUT_S = 1.0


class EmulatedPair:
    """Namespaces ``a`` (10.214.0.1) and ``b`` (10.214.0.2) joined by one emulated link whose
    directions both have ``shape``; a context manager that deletes them on exit."""

    def __init__(self, shape: LinkShape, *, seed: int | None = 0, log_dir: Path | None = None):
        tag = secrets.token_hex(3)
        self.a, self.b = f"{PREFIX}emu{tag}-a", f"{PREFIX}emu{tag}-b"
        self.link: EmulatedLink | None = None
        try:
            for name in (self.a, self.b):
                ip("netns", "add", name)
                ip("-n", name, "link", "set", "lo", "up")
            log_file = None if log_dir is None else log_dir / f"linkemu-{tag}.log"
            self.link = EmulatedLink(
                Endpoint(ifname="eth0", netns=self.a),
                Endpoint(ifname="eth0", netns=self.b),
                a_to_b=shape, b_to_a=shape, seed=seed, log_file=log_file,
            )  # fmt: skip
            for name, address in ((self.a, ADDRESS_A), (self.b, ADDRESS_B)):
                ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                ip("-n", name, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EmulatedPair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        for name in (self.a, self.b):
            delete_namespace(name)


def _in_namespace(name: str, function: Callable[[], Any]) -> Callable[[], Any]:
    """A thread target that runs ``function`` inside namespace ``name``; its result or error
    lands in the returned callable's ``result`` list."""
    results: list[Any] = []

    def target() -> None:
        try:
            netns.setns(name, flags=0)  # this thread only: setns(2) acts on the calling thread
            results.append(function())
        except BaseException as e:  # handed to the joining thread, which raises it
            results.append(e)

    target.results = results  # type: ignore[attr-defined]
    return target


def _run_pair(
    pair: EmulatedPair, server: Callable[[], Any], client: Callable[[], Any]
) -> tuple[Any, Any]:
    server_target = _in_namespace(pair.b, server)
    client_target = _in_namespace(pair.a, client)
    threads = [threading.Thread(target=t, daemon=True) for t in (server_target, client_target)]
    threads[0].start()
    time.sleep(0.2)  # the server binds first
    threads[1].start()
    for thread in threads:
        thread.join()
    out = []
    for target in (server_target, client_target):
        result = target.results[0]
        if isinstance(result, BaseException):
            raise result
        out.append(result)
    return out[0], out[1]


def measure_rtt_s(
    pair: EmulatedPair, *, num_pings: int = 100, interval_s: float = 0.01
) -> list[float]:
    """Round trip times of ``num_pings`` small UDP echoes from ``a`` to ``b``, one at a time
    (a lost one is left out after :data:`PING_TIMEOUT_S`)."""
    done = threading.Event()

    def server() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((ADDRESS_B, PORT))
            sock.settimeout(PING_TIMEOUT_S)
            while not done.is_set():
                try:
                    data, source = sock.recvfrom(64)
                except TimeoutError:
                    continue
                sock.sendto(data, source)

    def client() -> list[float]:
        rtts = []
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.settimeout(PING_TIMEOUT_S)
                for number in range(num_pings):
                    sent_s = time.monotonic()
                    sock.sendto(struct.pack("!I", number), (ADDRESS_B, PORT))
                    if _await_echo(sock, number):
                        rtts.append(time.monotonic() - sent_s)
                    time.sleep(interval_s)
        finally:
            done.set()
        return rtts

    return _run_pair(pair, server, client)[1]


def _await_echo(sock: socket.socket, number: int) -> bool:
    try:
        while struct.unpack("!I", sock.recv(64))[0] != number:
            pass  # a late echo of an earlier ping
    except TimeoutError:
        return False
    return True


def measure_tcp_bit_per_s(
    pair: EmulatedPair, *, duration_s: float = 6.0, warmup_s: float = 1.5
) -> float:
    """Goodput of one TCP flow from ``a`` to ``b``, bits of payload per second, measured at the
    receiver after ``warmup_s`` (slow start) for ``duration_s``."""

    def server() -> float:
        with socket.create_server((ADDRESS_B, PORT)) as listener:
            listener.settimeout(SOCKET_TIMEOUT_S)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(SOCKET_TIMEOUT_S)
                start_s = time.monotonic()
                while time.monotonic() - start_s < warmup_s:
                    conn.recv(CHUNK_BYTES)
                counted, measured_from_s = 0, time.monotonic()
                while time.monotonic() - measured_from_s < duration_s:
                    counted += len(conn.recv(CHUNK_BYTES))
                return counted * 8 / (time.monotonic() - measured_from_s)

    def client() -> None:
        payload = bytes(CHUNK_BYTES)
        with socket.create_connection((ADDRESS_B, PORT), timeout=SOCKET_TIMEOUT_S) as conn:
            try:
                while True:
                    conn.sendall(payload)
            except OSError:  # the receiver closed: the measurement is over
                return

    return _run_pair(pair, server, client)[0]


def measure_loss(pair: EmulatedPair, *, num_packets: int = 10_000, burst: int = 20) -> float:
    """The fraction of ``num_packets`` numbered UDP datagrams from ``a`` that ``b`` never got
    (paced, so that no queue but the emulator's random loss drops any)."""
    done = threading.Event()

    def server() -> set[int]:
        seen: set[int] = set()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.bind((ADDRESS_B, PORT))
            sock.settimeout(0.5)
            while True:
                try:
                    seen.add(struct.unpack("!I", sock.recv(64))[0])
                except TimeoutError:
                    if done.is_set():
                        return seen

    def client() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for number in range(num_packets):
                sock.sendto(struct.pack("!I", number), (ADDRESS_B, PORT))
                if number % burst == burst - 1:
                    time.sleep(0.002)
        done.set()

    _warm_up(pair)
    seen, _ = _run_pair(pair, server, client)
    return 1 - len(seen & set(range(num_packets))) / num_packets


def _warm_up(pair: EmulatedPair) -> None:
    """Resolve the neighbours (ARP) first, so that its queue drops nothing measured."""
    measure_rtt_s(pair, num_pings=5, interval_s=0.0)


def measure(shape: LinkShape, *, seed: int | None = 0) -> dict[str, Any]:
    """Every measurement with ``shape``, plus the forwarder's CPU cost while the TCP flow runs.

    RTT and throughput are taken on a pair without the loss (so that lost pings and TCP's
    reaction to loss do not blur them), loss on a pair with the loss only.
    """
    lossless = dataclasses.replace(shape, loss=0.0)
    with tempfile.TemporaryDirectory() as tmp, EmulatedPair(lossless, log_dir=Path(tmp)) as pair:
        _warm_up(pair)
        rtts = measure_rtt_s(pair)
        cpu_before_s, started_s = pair.link.cpu_s(), time.monotonic()
        bit_per_s = measure_tcp_bit_per_s(pair) if shape.rate_bit_per_s else None
        cpu_share = (pair.link.cpu_s() - cpu_before_s) / (time.monotonic() - started_s)
    loss = None
    if shape.loss:
        with EmulatedPair(LinkShape(loss=shape.loss), seed=seed) as pair:
            loss = measure_loss(pair)
    return {
        "rtt_ms_median": statistics.median(rtts) * 1e3,
        "rtt_ms_p90": statistics.quantiles(rtts, n=10)[-1] * 1e3,
        "num_pings": len(rtts),
        "tcp_mbit": None if bit_per_s is None else bit_per_s / 1e6,
        "forwarder_cpu_share_during_tcp": cpu_share if bit_per_s else None,
        "loss_percent": None if loss is None else loss * 100,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.linkemu.fidelity")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="one-way, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0)
    parser.add_argument("--loss-percent", type=float, default=0.0)
    args = parser.parse_args(argv)
    shape = shape_from(
        bandwidth_mbit=args.bandwidth_mbit, latency_ms=args.latency_ms,
        jitter_ms=args.jitter_ms, loss_percent=args.loss_percent,
    )  # fmt: skip
    print(json.dumps(measure(shape), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
