"""A swarm of thousands of peers on a virtual clock, in one process: progress and discovery.

The swarm, its peers and the events that drive them are :mod:`peer.bench.swarm_sim_events`
(what runs of a real peer, and what is a stand-in, is said there); this module runs it and
reports its figures.

The swarm joins over a ramp and settles before the measurement window of ``seconds``; every
figure but ``max_key_bytes_ramp`` is from that window. Figures (as ``peer bench swarm`` names
them where they mean the same): ``dht_bytes_per_peer_per_s`` (both sides of every DHT RPC a node
makes or answers, the mean node), ``max_node_dht_bytes_per_s`` and ``median_node_...``,
``max_key_bytes`` against ``key_cap_bytes``, ``in_group_fraction`` (ready peers that met another
under their key within the matchmaking wait), ``progress_error_p50``/``_p95`` (the relative error
of a peer's estimated samples at its epoch against the true sum, at every read where the truth is
past a tenth of the target), ``size_ratio_p05``/``_p50`` (a peer's estimate of the swarm's size
over the true size, at every read), ``layout_split_fraction`` (searches under a key layout other
than the one most searches of their epoch used).
Run it: ``python -m peer.bench.swarm_sim --peers 1000``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from averaging.matchmaking import rows
from dht.kademlia.config import DHTConfig
from peer.bench.swarm_sim_events import SimSwarm


def window_figures(swarm: SimSwarm, seconds: float) -> dict:
    """The figures of the module docstring, from the measurement window of a run swarm.

    Args:
        swarm: the swarm, run to the end of its window (:meth:`SimSwarm.run`).
        seconds: the window's length, in virtual seconds.

    Returns:
        The figures by name; the DHT's traffic counts only the peers alive the whole window.
    """
    end = swarm.dht.node_bytes
    start = swarm.bytes_at_window
    whole = [swarm.peers[p].slot for p in set(swarm.alive_at_window) & set(swarm.alive)]
    rates = sorted(float(end[s] - (start[s] if s < len(start) else 0)) / seconds for s in whole)
    return {
        "peers": len(swarm.alive),
        "seconds": seconds,
        "dht_bytes_per_peer_per_s": round(statistics.fmean(rates)) if rates else None,
        "max_node_dht_bytes_per_s": round(rates[-1]) if rates else None,
        "median_node_dht_bytes_per_s": round(statistics.median(rates)) if rates else None,
        "max_key_bytes": swarm.dht.max_key_bytes(),
        "max_key_bytes_ramp": swarm.max_key_bytes_ramp,
        "key_cap_bytes": DHTConfig().max_bytes_per_key,
        "in_group_fraction": _fraction(swarm.num_met, swarm.num_ready),
        "progress_error_p50": _percentile(swarm.errors, 0.5),
        "progress_error_p95": _percentile(swarm.errors, 0.95),
        "size_ratio_p05": _percentile(swarm.size_ratios, 0.05),
        "size_ratio_p50": _percentile(swarm.size_ratios, 0.5),
        "keys_read_per_interval_max": max(swarm.num_keys_read, default=0),
        "layout_split_fraction": rows.layout_split_fraction(swarm.layouts.values()),
        "rounds": swarm.num_ready,
        "epoch_max": max((swarm.peers[p].epoch for p in swarm.alive), default=0),
    }


def _fraction(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 4)


def simulate(
    num_peers: int,
    *,
    seconds: float = 60.0,
    churn_per_s: float = 0.0,
    seed: int = 0,
    target_group_size: int = 16,
    busy_s: float = 0.0,
    layout_memory: bool = True,
) -> dict:
    """Simulate ``num_peers`` peers for ``seconds`` of virtual time (after a ramp and a settling
    time); returns the figures of the module docstring, with ``wall_s`` (the run's own time).

    Args:
        num_peers: peers in the swarm (churn keeps the number).
        seconds: the measurement window, in virtual seconds.
        churn_per_s: the fraction of the swarm replaced per second (0.001: a peer in a thousand
            leaves, and a newcomer joins, every second), from the end of the ramp on.
        seed: seeds every random choice (the same seed, the same figures).
        target_group_size: ``g`` of matchmaking (its key has ``N // (2 g)`` shards).
        busy_s: a busy host: each refresh cycle runs up to this many seconds late (uniform).
        layout_memory: lay the keys out for the count of the last round (as peers do); False:
            from each peer's own estimate, for comparison.
    """
    for name, value, bad, wanted in (
        ("num_peers", num_peers, num_peers < 1, ">= 1"),
        ("seconds", seconds, not seconds > 0, "> 0"),
        ("churn_per_s", churn_per_s, not churn_per_s >= 0, ">= 0"),
        ("target_group_size", target_group_size, target_group_size < 2, ">= 2"),
        ("busy_s", busy_s, not busy_s >= 0, ">= 0"),
    ):
        if bad:
            raise ValueError(f"{name} must be {wanted}, got {value}")
    started_s = time.perf_counter()
    swarm = SimSwarm(
        num_peers, seconds, churn_per_s, seed, target_group_size, busy_s, layout_memory
    )
    swarm.run(num_peers, seconds, churn_per_s)
    return {
        **window_figures(swarm, seconds),
        "churn_per_s": churn_per_s,
        "wall_s": round(time.perf_counter() - started_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--churn", type=float, default=0.0, help="fraction replaced per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--busy-s", type=float, default=0.0, help="refresh cycles run this late")
    parser.add_argument(
        "--no-layout-memory", action="store_true", help="keys laid out from own estimates"
    )
    args = parser.parse_args(argv)
    report = simulate(
        args.peers,
        seconds=args.seconds,
        churn_per_s=args.churn,
        seed=args.seed,
        target_group_size=args.group_size,
        busy_s=args.busy_s,
        layout_memory=not args.no_layout_memory,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
