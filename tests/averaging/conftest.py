"""Peers for averaging tests: real HttpTransports on 127.0.0.1, in this process or in others.

* ``make_peers(n, ...)``: n in-process averagers without a DHT, for fixed groups
  (:func:`make_group` builds the group every member is given).
* ``make_swarm(n, ...)``: n in-process averagers, each with its own DHT node (matchmaking).
* ``spawn_peer(...)``: one averager in a subprocess (``peer_worker.py``), which a test can
  SIGKILL or SIGSTOP, or which kills or stops itself at a chosen chunk.
* :func:`exact_mean` is the reference: the weighted mean in float64.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from averaging.averager import DecentralizedAverager
from averaging.config import AveragerConfig
from averaging.matchmaking.group import GroupInfo, GroupMember
from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from tests.averaging.peer_worker import peer_values
from tests.helpers.child import JsonLinesChild

__all__ = ["exact_mean", "fast_config", "make_group", "peer_values", "steady_config"]

WORKER = Path(__file__).with_name("peer_worker.py")
FAST = {
    "matchmaking_time_s": 3.0,
    "request_timeout_s": 2.0,
    "allreduce_timeout_s": 20.0,
    "sender_timeout_s": 2.0,
    "reducer_timeout_s": 4.0,
    "group_wait_s": 2.0,
}


def fast_config(**changes: Any) -> AveragerConfig:
    """Short timeouts, so that failure paths end quickly in tests."""
    return AveragerConfig(**{**FAST, **changes})


def steady_config(**changes: Any) -> AveragerConfig:
    """Waits for tests that expect every member to arrive: on a loaded machine a member's first
    connection came after ``fast_config``'s 2-s sender wait, and the round was partial."""
    return fast_config(
        **{"sender_timeout_s": 10.0, "reducer_timeout_s": 20.0, "group_wait_s": 10.0, **changes}
    )


def sharded_round_config(group_size: int) -> AveragerConfig:
    """Generous waits for rounds of many DHT nodes on one event loop, so that a loaded machine
    makes no fault (16-20 nodes: announcing and reading a bucket took over 4 s under the full
    suite, and every peer then found nobody)."""
    return fast_config(
        target_group_size=group_size,
        row_grace_s=1.0,
        matchmaking_time_s=12.0,
        request_timeout_s=6.0,
        adaptive_deadlines=False,
        sender_timeout_s=5.0,
        reducer_timeout_s=10.0,
        group_wait_s=4.0,
    )


def exact_mean(vectors, weights) -> np.ndarray:
    """The weighted mean in float64 (the reference every result is checked against)."""
    total = sum(
        float(w) * np.asarray(v, dtype=np.float64) for v, w in zip(vectors, weights, strict=True)
    )
    return total / float(sum(weights))


def make_group(peers, weights=None, compression="none", chunk_numel=16 * 1024) -> GroupInfo:
    """A group of ``peers`` (objects with peer_id and address), ordered by peer id."""
    weights = weights or [1.0] * len(peers)
    members = sorted(
        (
            GroupMember(p.peer_id, p.address, 1.0, float(w))
            for p, w in zip(peers, weights, strict=True)
        ),
        key=lambda m: m.peer_id,
    )
    return GroupInfo(secrets.token_hex(8), tuple(members), compression, chunk_numel)


@dataclass
class Peer:
    """An in-process peer: its transport, averager, tensors and (maybe) DHT node."""

    transport: HttpTransport
    averager: DecentralizedAverager
    tensors: list
    node: DHTNode | None = None

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def address(self) -> str | None:
        return self.transport.address


@dataclass
class _Started:
    peers: list[Peer] = field(default_factory=list)

    async def close(self) -> None:
        for peer in self.peers:
            await peer.averager.close()
            if peer.node is not None:
                await peer.node.close()
            await peer.transport.close()


def _transport(client_mode: bool) -> HttpTransport:
    return HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=client_mode))


@pytest.fixture
async def make_peers():
    """Factory: ``await make_peers(tensor_lists, config=..., client_mode=set_of_indices)``."""
    started = _Started()

    async def make(tensor_lists, *, config=None, client_mode=(), prefix="t") -> list[Peer]:
        peers = []
        for index, tensors in enumerate(tensor_lists):
            transport = _transport(index in client_mode)
            averager = DecentralizedAverager(
                tensors, transport=transport, dht=None, prefix=prefix, config=config
            )
            await transport.start()
            peers.append(Peer(transport, averager, tensors))
            started.peers.append(peers[-1])
        return peers

    yield make
    await started.close()


@pytest.fixture
async def make_swarm():
    """Factory: ``await make_swarm(tensor_lists, config=..., client_mode=set_of_indices)``;
    ``identities=`` gives the peers' identities (generated where left out)."""
    started = _Started()

    async def make(
        tensor_lists, *, config=None, client_mode=(), prefix="t", identities=()
    ) -> list[Peer]:
        peers = []
        for index, tensors in enumerate(tensor_lists):
            identity = identities[index] if index < len(identities) else PeerIdentity.generate()
            transport = HttpTransport(identity, TransportConfig(client_mode=index in client_mode))
            bootstrap = [p.address for p in started.peers[:2] if p.address]
            node = DHTNode(
                transport=transport,
                identity=identity,
                config=DHTConfig(initial_peers=bootstrap, rpc_timeout_s=2.0),
            )
            averager = DecentralizedAverager(
                tensors, transport=transport, dht=node, prefix=prefix, config=config
            )
            await transport.start()
            await node.start()
            peers.append(Peer(transport, averager, tensors, node))
            started.peers.append(peers[-1])
        return peers

    yield make
    await started.close()


class PeerProcess(JsonLinesChild):
    """An averager in a subprocess, driven over its stdin/stdout (one JSON object a line)."""

    name = "peer process"

    def __init__(self, spec: dict[str, Any]):
        super().__init__(WORKER, spec)

    def run_group(self, group: GroupInfo) -> None:
        self.send({"group": group.to_wire()})

    async def result(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return await self.receive(timeout_s)


@pytest.fixture
async def spawn_peer():
    """Factory: ``await spawn_peer(spec)`` starts ``peer_worker.py``; all are killed at teardown.

    The spec holds ``seed``, ``rank``, ``size``, ``weight``, ``config`` (AveragerConfig fields),
    ``out`` (where the averaged vector is saved, .npy) and optionally ``fault`` (see
    ``peer_worker.py``).
    """
    processes: list[PeerProcess] = []

    async def spawn(spec: dict[str, Any]) -> PeerProcess:
        process = PeerProcess(spec)
        processes.append(process)
        return await process.started(timeout_s=30.0)

    yield spawn
    for process in processes:
        process.kill()
