"""Thousands of DHT nodes in one process over :class:`dht.tools.memory.MemoryNetwork`, with churn.

The simulation bootstraps ``num_nodes`` nodes (concurrently, in batches, each from a random node
already up), stores ``num_keys`` values from random nodes, kills a fraction of the nodes at random
(and optionally starts new ones), then gets every key from a random surviving node and reports
how deep the lookups went and how many values survived. Identities and every random choice derive
from ``seed``; timing still varies with scheduling.

Run it: ``python -m dht.tools.simulation --nodes 1000 --churn 0.2 --keys 500``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.identity import PeerIdentity
from dht.kademlia.config import Clock, DHTConfig, SystemClock
from dht.kademlia.node import DHTNode
from dht.kademlia.outcomes import GetOutcome
from dht.tools.memory import LatencyModel, MemoryNetwork, MemoryTransport

# Maintenance would only add noise to a run of a minute: refresh and republish stay out of it.
_QUIET_INTERVAL_S = 24 * 3600.0


@dataclass(frozen=True)
class SimulationReport:
    """What a simulation measured; lookups answered from the own replica count no hops.

    Attributes:
        num_nodes: nodes bootstrapped.
        num_killed: nodes killed after the stores.
        num_joined: nodes started after the kills.
        num_keys: values stored (and then looked up).
        store_success_rate: fraction of stores that at least one replica accepted.
        get_success_rate: fraction of keys whose get returned exactly the stored value.
        hops_median: median depth of the gets that went over the network.
        hops_p90: 90th percentile of that depth.
        hops_max: the deepest get.
        num_local_gets: gets answered by the getter's own replica (no lookup).
        avg_known_peers: mean routing table size of the surviving nodes.
        num_calls: RPCs carried by the network in all.
        bootstrap_s: wall time to bootstrap every node, in seconds.
        store_s: wall time of all the stores, in seconds.
        get_s: wall time of all the gets, in seconds.
        total_s: wall time of the whole run, in seconds.
    """

    num_nodes: int
    num_killed: int
    num_joined: int
    num_keys: int
    store_success_rate: float
    get_success_rate: float
    hops_median: float
    hops_p90: float
    hops_max: int
    num_local_gets: int
    avg_known_peers: float
    num_calls: int
    bootstrap_s: float
    store_s: float
    get_s: float
    total_s: float

    def to_dict(self) -> dict:
        return asdict(self)


class _Swarm:
    def __init__(self, network: MemoryNetwork, rng: random.Random, config: DHTConfig, clock: Clock):
        self.network = network
        self.rng = rng
        self.config = config
        self.clock = clock
        self.alive: list[DHTNode] = []

    def _identity(self) -> PeerIdentity:
        return PeerIdentity(Ed25519PrivateKey.from_private_bytes(self.rng.randbytes(32)))

    async def add_nodes(self, count: int, batch_size: int) -> None:
        """Start ``count`` nodes, ``batch_size`` at a time, each from a random running node."""
        remaining = count
        if not self.alive and remaining:
            self.alive.append(await self._start_node(initial_peers=[]))
            remaining -= 1
        while remaining > 0:
            batch = min(batch_size, remaining)
            num_entry_points = min(2, len(self.alive))
            entry_points = [
                [node.address for node in self.rng.sample(self.alive, num_entry_points)]
                for _ in range(batch)
            ]
            started = await asyncio.gather(*(self._start_node(urls) for urls in entry_points))
            self.alive.extend(started)
            remaining -= batch

    async def _start_node(self, initial_peers: list[str]) -> DHTNode:
        identity = self._identity()
        transport = MemoryTransport(self.network, identity.peer_id)
        config = replace(self.config, initial_peers=initial_peers)
        node = DHTNode(transport=transport, identity=identity, config=config, clock=self.clock)
        await transport.start()
        await node.start()
        return node

    async def kill(self, count: int) -> None:
        victims = self.rng.sample(self.alive, count)
        for node in victims:
            self.network.kill(node.address)
            await node.close()
        gone = {id(node) for node in victims}
        self.alive = [node for node in self.alive if id(node) not in gone]

    async def close(self) -> None:
        for node in self.alive:
            await node.close()
            await node.transport.close()
        self.alive = []


async def _in_batches(jobs: list[Callable[[], Awaitable]], batch_size: int) -> list:
    results = []
    for start in range(0, len(jobs), batch_size):
        results.extend(await asyncio.gather(*(job() for job in jobs[start : start + batch_size])))
    return results


def _percentile(values: list[int], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))])


async def run_simulation(
    num_nodes: int,
    churn_fraction: float,
    num_keys: int,
    latency: LatencyModel | None = None,
    seed: int = 0,
    *,
    join_fraction: float = 0.0,
    batch_size: int = 64,
    config: DHTConfig | None = None,
    clock: Clock | None = None,
) -> SimulationReport:
    """Run one simulation on the current event loop (see the module docstring).

    Args:
        num_nodes: nodes to bootstrap.
        churn_fraction: fraction of them killed after the stores.
        num_keys: values to store and get.
        latency: the network's delays and losses (default: none).
        seed: seeds identities, choices and latency draws.
        join_fraction: fraction of ``num_nodes`` started anew after the kills.
        batch_size: how many nodes bootstrap (and operations run) concurrently.
        config: node settings (initial peers are chosen here; maintenance stays quiet).
        clock: the wall clock of every node's expirations (default: the system's).
    """
    if not 0 <= churn_fraction < 1:
        raise ValueError(f"churn_fraction must be in [0, 1), got {churn_fraction}")
    rng = random.Random(seed)
    config = config or DHTConfig(rpc_timeout_s=1.0)
    config = replace(
        config, refresh_interval_s=_QUIET_INTERVAL_S, republish_interval_s=_QUIET_INTERVAL_S
    )
    clock = clock or SystemClock()
    swarm = _Swarm(MemoryNetwork(latency, seed=seed), rng, config, clock)
    started_s = time.perf_counter()
    try:
        await swarm.add_nodes(num_nodes, batch_size)
        bootstrap_s = time.perf_counter() - started_s

        expiration = clock.time() + 3600
        values = {f"sim-key-{i}": {"i": i, "tag": rng.randbytes(8)} for i in range(num_keys)}
        writers = [rng.choice(swarm.alive) for _ in values]
        stores = [
            (lambda w=w, k=k, v=v: w.store(k, v, expiration))
            for w, (k, v) in zip(writers, values.items(), strict=True)
        ]
        mark_s = time.perf_counter()
        stored = await _in_batches(stores, batch_size)
        store_s = time.perf_counter() - mark_s

        num_killed = int(churn_fraction * num_nodes)
        await swarm.kill(num_killed)
        num_joined = int(join_fraction * num_nodes)
        await swarm.add_nodes(num_joined, batch_size)

        readers = [rng.choice(swarm.alive) for _ in values]
        gets = [(lambda r=r, k=k: r.get_outcome(k)) for r, k in zip(readers, values, strict=True)]
        mark_s = time.perf_counter()
        outcomes: list[GetOutcome] = await _in_batches(gets, batch_size)
        get_s = time.perf_counter() - mark_s
    finally:
        avg_known = statistics.fmean(n.num_known_peers for n in swarm.alive) if swarm.alive else 0
        await swarm.close()
    found = [
        o.value is not None and o.value.value == v
        for o, v in zip(outcomes, values.values(), strict=True)
    ]
    hops = [o.hops for o in outcomes if o.source == "network"]
    return SimulationReport(
        num_nodes=num_nodes,
        num_killed=num_killed,
        num_joined=num_joined,
        num_keys=num_keys,
        store_success_rate=sum(stored) / max(1, num_keys),
        get_success_rate=sum(found) / max(1, num_keys),
        hops_median=float(statistics.median(hops)) if hops else float("nan"),
        hops_p90=_percentile(hops, 0.9),
        hops_max=max(hops, default=0),
        num_local_gets=sum(o.source == "local" for o in outcomes),
        avg_known_peers=avg_known,
        num_calls=swarm.network.num_calls,
        bootstrap_s=bootstrap_s,
        store_s=store_s,
        get_s=get_s,
        total_s=time.perf_counter() - started_s,
    )


def simulate(
    num_nodes: int,
    churn_fraction: float,
    num_keys: int,
    latency: LatencyModel | None = None,
    seed: int = 0,
    **options,
) -> SimulationReport:
    """Run :func:`run_simulation` in a fresh event loop (from synchronous code)."""
    return asyncio.run(
        run_simulation(num_nodes, churn_fraction, num_keys, latency, seed, **options)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--churn", type=float, default=0.2)
    parser.add_argument("--join", type=float, default=0.0)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--jitter-ms", type=float, default=1.0)
    parser.add_argument("--drop", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    latency = LatencyModel(
        base_s=args.latency_ms / 1000, jitter_s=args.jitter_ms / 1000, drop_probability=args.drop
    )
    report = simulate(
        args.nodes, args.churn, args.keys, latency, args.seed, join_fraction=args.join
    )
    print(json.dumps(report.to_dict()))


if __name__ == "__main__":
    main()
