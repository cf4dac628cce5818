"""One averaging peer in its own process, for tests that SIGKILL or SIGSTOP a peer.

Protocol (one JSON object a line): the test writes the spec on stdin; the worker answers
``{"peer_id", "address"}`` once its transport serves; the test writes ``{"group": ...}``; the
worker averages with that group, saves its vector to ``spec["out"]`` and answers with the result.

``spec["fault"] = {"action": "kill"|"stop", "on": "send"|"reply"|"recv", "after": n}`` makes the
worker SIGKILL or SIGSTOP itself once, as a sender, it has sent ``n`` tensor chunks or received
``n`` averaged chunks back (so at least ``n`` of its chunks were delivered), or, as a reducer, it
has received ``n`` chunks: a peer that dies or stalls in the middle of a round. The worker runs
one round per group written to it, each from its own starting vector; the fault is armed in
round ``spec["fault"]["round"]`` (default 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import numpy as np

from averaging.allreduce.protocol import CHUNK_HEADER
from averaging.averager import DecentralizedAverager
from averaging.config import AveragerConfig
from averaging.matchmaking.group import GroupInfo
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig


def peer_values(seed: int, rank: int, size: int) -> np.ndarray:
    """Peer ``rank``'s random vector (the tests draw the same to compute the reference)."""
    return np.random.default_rng([seed, rank]).standard_normal(size).astype(np.float32)


class Fault:
    """Counts tensor chunks in one direction and kills or stops this process at the n-th."""

    def __init__(self, spec: dict[str, Any] | None):
        self.spec = spec or {}
        self.count = 0
        self.armed = False

    def chunk(self, direction: str, num_bytes: int) -> None:
        if not self.armed or self.spec.get("on") != direction or num_bytes <= CHUNK_HEADER.size:
            return
        self.count += 1
        if self.count >= self.spec["after"]:
            action = signal.SIGKILL if self.spec["action"] == "kill" else signal.SIGSTOP
            os.kill(os.getpid(), action)


class _Outgoing:
    def __init__(self, inner, fault: Fault):
        self._inner, self._fault = inner, fault

    async def __aenter__(self):
        self._stream = await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info):
        return await self._inner.__aexit__(*exc_info)

    async def send(self, chunk) -> None:
        await self._stream.send(chunk)
        self._fault.chunk("send", len(memoryview(chunk).cast("B")))

    async def recv_into(self, buffer):
        num_bytes = await self._stream.recv_into(buffer)
        self._fault.chunk("reply", num_bytes or 0)
        return num_bytes

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Incoming:
    def __init__(self, inner, fault: Fault):
        self._inner, self._fault = inner, fault
        self.sender, self.header = inner.sender, inner.header

    async def recv_into(self, buffer):
        num_bytes = await self._inner.recv_into(buffer)
        self._fault.chunk("recv", num_bytes or 0)
        return num_bytes

    def __getattr__(self, name):
        return getattr(self._inner, name)


class FaultyTransport:
    """Wraps a transport; its streams report every chunk to a :class:`Fault`."""

    def __init__(self, inner: HttpTransport, fault: Fault):
        self._inner, self._fault = inner, fault
        self.peer_id, self.counters = inner.peer_id, inner.counters

    @property
    def address(self):
        return self._inner.address

    def add_rpc_handler(self, name, handler) -> None:
        self._inner.add_rpc_handler(name, handler)

    def add_stream_handler(self, name, handler) -> None:
        async def wrapped(stream):
            await handler(_Incoming(stream, self._fault))

        self._inner.add_stream_handler(name, wrapped)

    async def call(self, *args, **kwargs):
        return await self._inner.call(*args, **kwargs)

    def open_stream(self, *args, **kwargs):
        return _Outgoing(self._inner.open_stream(*args, **kwargs), self._fault)


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main() -> None:
    spec = json.loads(sys.stdin.readline())
    values = peer_values(spec["seed"], spec["rank"], spec["size"])
    inner = HttpTransport(PeerIdentity.generate(), TransportConfig())
    fault = Fault(spec.get("fault"))
    transport = FaultyTransport(inner, fault)
    config = AveragerConfig(**spec.get("config", {}))
    averager = DecentralizedAverager(
        [values], transport=transport, dht=None, prefix="t", config=config
    )
    async with inner, averager:
        _say({"peer_id": inner.peer_id, "address": inner.address})
        round_index = 0
        while line := await asyncio.to_thread(sys.stdin.readline):
            values[:] = peer_values(spec["seed"], spec["rank"], spec["size"])
            fault.armed = round_index == fault.spec.get("round", 0)
            result = await averager.step_in_group(GroupInfo.from_wire(json.loads(line)["group"]))
            np.save(spec["out"], values)
            _say({"status": result.status, "dropped": list(result.dropped_peers)})
            round_index += 1


if __name__ == "__main__":
    asyncio.run(main())
