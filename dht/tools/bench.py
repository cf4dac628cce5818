"""``peer bench dht``: N real nodes on loopback, each its own server, in this process."""

from __future__ import annotations

import random
import statistics
import time
from contextlib import AsyncExitStack

import psutil

from dht.identity import PeerIdentity
from dht.kademlia.config import DHTConfig, get_dht_time
from dht.launch import open_node
from dht.net.config import TransportConfig

EXPIRATION_S = 600.0


def _percentile_ms(samples_s: list[float], fraction: float) -> float:
    ordered = sorted(samples_s)
    index = min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))
    return round(ordered[index] * 1000, 3)


async def run_dht_bench(*, num_nodes: int, num_keys: int, seed: int = 0) -> dict:
    """Bootstrap ``num_nodes`` nodes one after another, then store and get ``num_keys`` values.

    Each value is stored from a random node and read back from another random node. Returns the
    contract fields of DESIGN.md (plus ``rss_mb_per_node``, the growth of resident memory per
    node started); ``rss_mb`` is this process's resident memory with all nodes running,
    ``bootstrap_s`` the median time for a node to start and join.
    """
    rng = random.Random(seed)
    rss_before_mb = psutil.Process().memory_info().rss / 2**20
    async with AsyncExitStack() as stack:
        nodes, bootstrap_s = [], []
        for _ in range(num_nodes):
            initial = [rng.choice(nodes).address] if nodes else []
            start = time.perf_counter()
            node = await stack.enter_async_context(
                open_node(
                    PeerIdentity.generate(), TransportConfig(), DHTConfig(initial_peers=initial)
                )
            )
            if nodes:
                bootstrap_s.append(time.perf_counter() - start)
            nodes.append(node)

        writers, store_s, num_stored = [], [], 0
        for index in range(num_keys):
            writer = rng.choice(nodes)
            writers.append(writer)
            start = time.perf_counter()
            ok = await writer.store(
                f"bench/{seed}/{index}", {"index": index}, get_dht_time() + EXPIRATION_S
            )
            store_s.append(time.perf_counter() - start)
            num_stored += bool(ok)

        get_s, num_found = [], 0
        for index, writer in enumerate(writers):
            reader = rng.choice([n for n in nodes if n is not writer] or nodes)
            start = time.perf_counter()
            found = await reader.get(f"bench/{seed}/{index}")
            get_s.append(time.perf_counter() - start)
            num_found += found is not None and found.value == {"index": index}

        rss_mb = psutil.Process().memory_info().rss / 2**20
    return {
        "nodes": num_nodes,
        "store_ok": round(num_stored / num_keys, 4),
        "get_ok": round(num_found / num_keys, 4),
        "get_p50_ms": _percentile_ms(get_s, 0.5),
        "get_p99_ms": _percentile_ms(get_s, 0.99),
        "store_p50_ms": _percentile_ms(store_s, 0.5),
        "bootstrap_s": round(statistics.median(bootstrap_s), 4) if bootstrap_s else 0.0,
        "rss_mb": round(rss_mb, 1),
        "rss_mb_per_node": round((rss_mb - rss_before_mb) / num_nodes, 2),
    }
