"""One light peer of ``peer bench swarm``: the real DHT, progress tracker and averager, with a
stand-in for training.

The peer "trains" by sleeping one local step (``step_s``) and adding the samples its rate makes
in that time; after each step it reports its progress and reads the swarm's estimate, as the
collaborative optimizer does (:mod:`peer.swarm.optimizer`): when the swarm is ready (or will be
before its next step), it puts its epoch's vector (:mod:`peer.bench.swarm_vectors`) into the
averager's tensor and averages with the peers at its epoch, weighted by its samples. A peer
that finds the swarm one epoch ahead averages at once with whoever is still at its epoch; one
that finds it further ahead, or nobody left at its epoch, jumps to the swarm's epoch (a real one
downloads the state there).
Every round becomes one fact for the parent (:meth:`SwarmPeer.round_fact`), the replica it got
included.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import random
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from averaging.averager import DecentralizedAverager
from averaging.config import AveragerConfig
from averaging.result import RoundResult
from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from peer.bench.swarm_vectors import peer_rate, peer_vector
from peer.swarm.moved_on import moved_on, stop_when_moved_on
from peer.swarm.progress import GlobalProgress, ProgressConfig, ProgressTracker

PREFIX = "bench.swarm"
# RPCs whose bytes are the DHT's (the rest are matchmaking's: "averaging.<prefix>.join" ...)
DHT_RPC_PREFIX = "dht."
# Whether DecentralizedAverager.step takes the number of peers ready at the epoch (then it
# balances groups and reaches one mean across them); else groups are closed at that many.
STEP_TAKES_EXPECTED_PEERS = (
    "expected_peers" in inspect.signature(DecentralizedAverager.step).parameters
)


def peers_at(swarm: GlobalProgress, epoch: int) -> int:
    """How many peers of the swarm are at ``epoch``, as the optimizer counts them
    (:meth:`GlobalProgress.num_at`): a large swarm's records are a sample, each standing for
    several peers. Counting the records read instead planned 256 peers' rounds for 46 to 77
    (rows whose top round closed once that many were in, leaving most rows out)."""
    return swarm.num_at(epoch)


@dataclass(frozen=True, kw_only=True)
class PeerSpec:
    """What every peer of a run shares (the parent's config, as the child gets it).

    Attributes:
        size: float32 values averaged per round.
        seed: seeds the rates and vectors.
        last_epoch: a peer stops averaging once it reaches this epoch (None: until stopped).
        samples_per_s: the mean rate of a peer (each has its own, see ``peer_rate``).
        step_s: seconds of one local step (the peer reads the estimate after each).
        progress: the progress tracker's config (the target batch size in it).
        averager: the averager's config (its target_group_size is the group size cap).
        step_timeout_s: bound on one averaging step, in seconds.
        rpc_timeout_s: bound on one DHT request, in seconds.
        bootstrap_timeout_s: bound on reaching the initial peers when joining, in seconds.
        shared_address: every peer on 127.0.0.1 (else each on :func:`loopback_host`).
    """

    size: int
    seed: int
    last_epoch: int | None
    samples_per_s: float
    step_s: float
    progress: ProgressConfig
    averager: AveragerConfig
    step_timeout_s: float
    rpc_timeout_s: float
    bootstrap_timeout_s: float
    shared_address: bool = False


def loopback_host(rank: int) -> str:
    """The loopback address of peer ``rank``: ``127.1.x.y``, one per peer (y in 1..250), so
    that each node's limits per source address count one peer, as on the internet (Linux
    routes all of 127.0.0.0/8 to the loopback interface)."""
    if not 0 <= rank < 250 * 256:
        raise ValueError(f"rank must be in [0, 64000), got {rank}")
    return f"127.1.{rank // 250}.{rank % 250 + 1}"


class SwarmPeer:
    """One peer: its own identity, transport on 127.0.0.1, DHT node, tracker and averager."""

    def __init__(self, rank: int, spec: PeerSpec, initial_peers: list[str]):
        self.rank = rank
        self.spec = spec
        identity = PeerIdentity.generate()
        host = "127.0.0.1" if spec.shared_address else loopback_host(rank)
        self.transport = HttpTransport(identity, TransportConfig(host=host, source_host=host))
        dht_config = DHTConfig(
            initial_peers=tuple(initial_peers),
            rpc_timeout_s=spec.rpc_timeout_s,
            bootstrap_timeout_s=spec.bootstrap_timeout_s,
        )
        self.node = DHTNode(transport=self.transport, identity=identity, config=dht_config)
        self.tensor = np.zeros(spec.size, dtype=np.float32)
        self.averager = DecentralizedAverager(
            [self.tensor],
            transport=self.transport,
            dht=self.node,
            prefix=PREFIX,
            config=spec.averager,
        )
        self.tracker = ProgressTracker(dht=self.node, prefix=PREFIX, config=spec.progress)
        self.rate_per_s = peer_rate(spec.seed, rank, spec.samples_per_s)
        self.epoch = 0
        self.samples = 0.0
        self.last_estimate: GlobalProgress | None = None  # what the last step read
        self._stack = AsyncExitStack()

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    async def start(self) -> None:
        """Serve, join the DHT and start publishing progress."""
        for part in (self.transport, self.node, self.averager, self.tracker):
            await self._stack.enter_async_context(part)

    async def close(self) -> None:
        """Stop publishing, leave the DHT, stop serving (in that order)."""
        await self._stack.aclose()

    def rpc_bytes(self) -> dict[str, int]:
        """Body bytes sent and received so far by this node's RPCs, both sides, per name."""
        return {n: c.sent + c.recv for n, c in list(self.transport.counters.per_rpc.items())}

    def dht_bytes(self) -> tuple[int, int]:
        """(sent, received) body bytes of this node's DHT RPCs so far, both sides."""
        sent = recv = 0
        for name, counted in list(self.transport.counters.per_rpc.items()):
            if name.startswith(DHT_RPC_PREFIX):
                sent, recv = sent + counted.sent, recv + counted.recv
        return sent, recv

    def matchmaking_bytes(self) -> int:
        """Body bytes of this averager's matchmaking RPCs so far, sent and received."""
        return sum(
            c.sent + c.recv
            for name, c in list(self.transport.counters.per_rpc.items())
            if name.startswith("averaging.")
        )

    async def run(self, report: Callable[[dict[str, Any]], None]) -> None:
        """Train and average until ``last_epoch`` (or until cancelled)."""
        spec = self.spec
        batch = self.rate_per_s * spec.step_s
        await asyncio.sleep(random.uniform(0.0, spec.step_s))  # peers do not step in lockstep
        self.tracker.report_local_progress(self.epoch, 0)
        while spec.last_epoch is None or self.epoch < spec.last_epoch:
            await asyncio.sleep(spec.step_s)
            self.samples += batch
            self.tracker.report_local_progress(self.epoch, int(self.samples))
            swarm = self.last_estimate = self.tracker.current()
            num_at_epoch = peers_at(swarm, self.epoch)
            if self._behind(swarm, num_at_epoch):  # a real peer downloads the state here
                report({"type": "caught_up", "rank": self.rank, "epoch": self.epoch,
                        "to_epoch": swarm.epoch})  # fmt: skip
                self._enter(swarm.epoch)
            elif self._ready(swarm, num_at_epoch):
                report(await self._average(num_at_epoch))

    def _behind(self, swarm: GlobalProgress, num_at_epoch: int) -> bool:
        # as the optimizer: more than one epoch behind, or one with nobody left at this epoch
        if swarm.epoch <= self.epoch:
            return False
        return swarm.epoch > self.epoch + 1 or num_at_epoch <= 1

    def _ready(self, swarm: GlobalProgress, num_at_epoch: int) -> bool:
        # as the optimizer: the swarm moved on (average what we have with those still here),
        # the target is reached, or it is nearer now than after the next step
        if swarm.epoch > self.epoch:
            return True
        if swarm.ready or num_at_epoch <= 1:
            return swarm.ready
        own_rate = swarm.peers[0].samples_per_s if swarm.peers else 0.0
        step_s = self.rate_per_s * self.spec.step_s / own_rate if own_rate > 0 else 0.0
        return swarm.eta_next_epoch_s <= 0.5 * step_s

    async def _average(self, num_at_epoch: int) -> dict[str, Any]:
        epoch, weight = self.epoch, float(int(self.samples))
        self.tensor[:] = peer_vector(self.spec.seed, self.rank, epoch, self.spec.size)
        start = time.monotonic()
        if num_at_epoch <= 1:  # nobody else at this epoch: no matchmaking for a group of one
            result = RoundResult("alone", "nobody else at the epoch")
        else:
            # as the optimizer: stop looking once the swarm has left this epoch, or a peer left
            # out enters the next epoch late, is planned for as one behind, and is left out again
            result = await self.averager.step(
                weight, epoch=epoch, timeout_s=self.spec.step_timeout_s,
                stop_when=stop_when_moved_on(moved_on(self.tracker, epoch)),
                **self._group_hint(num_at_epoch),
            )  # fmt: skip
        round_s = time.monotonic() - start
        self._enter(epoch + 1)
        if result.averaged and len(result.averaged_with) > 1:
            self.tracker.note_round(self.epoch, result.averaged_with, result.num_reached)
        return self.round_fact(epoch, weight, num_at_epoch, result, round_s)

    def _group_hint(self, num_at_epoch: int) -> dict[str, int]:
        if STEP_TAKES_EXPECTED_PEERS:
            return {"expected_peers": num_at_epoch}
        config = self.spec.averager
        size = max(config.min_group_size, min(num_at_epoch, config.target_group_size))
        return {"target_group_size": size}

    def _enter(self, epoch: int) -> None:
        self.epoch, self.samples = epoch, 0.0
        self.tracker.report_local_progress(epoch, 0)

    def round_fact(
        self, epoch: int, weight: float, num_at_epoch: int, result: RoundResult, round_s: float
    ) -> dict[str, Any]:
        """What the parent learns of one round: who, with whom, how long, and the replica."""
        return {
            "type": "round",
            "rank": self.rank,
            "peer_id": self.peer_id,
            "epoch": epoch,
            "weight": weight,
            "expected_peers": num_at_epoch,
            "status": result.status,
            "reason": result.reason,
            "group_id": result.group_id,
            "search_key": result.search_key,
            "members": list(result.members),
            "averaged_with": list(result.averaged_with),
            "round_s": round_s,
            "matchmaking_s": result.matchmaking_s,
            "allreduce_s": result.allreduce_s,
            "bytes_sent": result.bytes_sent,
            "levels": dict(result.levels),
            "end_time": time.time(),
            "replica": base64.b64encode(self.tensor.tobytes()).decode("ascii"),
        }
