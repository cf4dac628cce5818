"""The figures of ``peer bench swarm`` from what its processes reported (see
:mod:`peer.bench.swarm`): per epoch, who was ready, who averaged in which group, and how far the
replicas are from each other and from the exact weighted mean in float64."""

from __future__ import annotations

import base64
import itertools
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from averaging.matchmaking.rows import key_buckets, layout_split_fraction
from peer.bench.swarm_peer import STEP_TAKES_EXPECTED_PEERS
from peer.bench.swarm_vectors import exact_weighted_mean


def _percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    return round(float(np.quantile(np.asarray(values), fraction)), 4)


_MAX_REASON_CHARS = 100  # a reason's first clause, cut here
_REASON_NUMBERS = re.compile(r"[0-9a-f]{8,}|\d+(\.\d+)?")
# replicas this close (relative) are one model: float32 rounding of a two-level mean is ~1e-7
SAME_MODEL_REL_TOL = 1e-5


def _significant(value: float) -> float:
    return float(f"{value:.3g}")


def _largest(values: Iterable[float]) -> float | None:
    values = list(values)
    return _significant(max(values)) if values else None


def _in_group(fact: dict[str, Any]) -> bool:
    return fact["status"] in ("ok", "partial") and len(fact["averaged_with"]) > 1


def epoch_detail(
    facts: list[dict[str, Any]], seed: int, size: int, peers_per_process: int | None = None
) -> dict[str, Any]:
    """One epoch: peers ready, in a group, the groups' sizes, the replicas' spread (largest
    ||x_i - mean|| / ||mean|| over replicas, mean = their plain mean) and their largest
    relative error against the exact weighted mean of every ready peer's vector; with
    ``peers_per_process``, when each process's peers started their rounds."""
    epoch = facts[0]["epoch"]
    weights = {fact["rank"]: fact["weight"] for fact in facts}
    exact = exact_weighted_mean(seed, size, epoch, weights)
    replicas = np.stack(
        [np.frombuffer(base64.b64decode(f["replica"]), dtype=np.float32) for f in facts]
    ).astype(np.float64)
    spread = _spread(replicas)
    errors = np.linalg.norm(replicas - exact, axis=1) / max(np.linalg.norm(exact), 1e-300)
    together = replicas[[_in_group(f) for f in facts]]
    groups, delegates = rows_and_delegates(facts)
    starts = {f["rank"]: f["end_time"] - f["round_s"] for f in facts}
    first_start = min(starts.values())
    by_process: dict[int, list[float]] = defaultdict(list)
    for rank, start in starts.items():
        by_process[rank // peers_per_process if peers_per_process else 0].append(start)
    return {
        "epoch": epoch,
        "ready": len(facts),
        "in_group": sum(_in_group(f) for f in facts),
        "statuses": dict(sorted(Counter(f["status"] for f in facts).items())),
        # why rounds did not fully average, most frequent first (the first clause, numbers and
        # ids blanked)
        "reasons": dict(
            Counter(
                _REASON_NUMBERS.sub("N", f["reason"].split("; ")[0])[:_MAX_REASON_CHARS]
                for f in facts
                if f.get("reason")
            ).most_common(3)
        ),
        "group_sizes": sorted(groups.values(), reverse=True),
        "num_delegates": len(delegates),
        "bandwidth_bound_bytes_per_peer": round(
            bandwidth_bound_bytes(groups.values(), len(delegates), size) / len(facts)
        ),
        "layouts": dict(sorted(Counter(key_buckets(f["search_key"]) for f in facts).items())),
        "expected_peers_p50": statistics.median(f["expected_peers"] for f in facts),
        "replica_spread": spread,
        "exact_rel_err_max": float(errors.max()),
        # the same spread over the peers that averaged with others only (a peer whose round
        # failed keeps its own vector and makes replica_spread about 1 on its own), and how many
        # models those peers ended with
        "in_group_spread": _spread(together) if len(together) else None,
        "num_models": num_models(together),
        "end_time": max(f["end_time"] for f in facts),
        # seconds between the first and the last peer of the epoch starting its round
        "start_spread_s": max(starts.values()) - first_start,
        # per process (by index), its peers' median round start after the epoch's first: a
        # process whose peers all start late is one whose event loop lags, not its peers
        "process_start_s": [
            round(statistics.median(by_process[i]) - first_start, 2) for i in sorted(by_process)
        ],
    }


def rows_and_delegates(facts: list[dict[str, Any]]) -> tuple[dict[str, int], set[str]]:
    """The epoch's rows (group id: members) and the delegates that reached a top group (a
    row's group id, or the peer id of a row of one, which reports the top group as its own)."""
    rows: dict[str, int] = {}
    delegates: set[str] = set()
    for fact in facts:
        levels = fact.get("levels") or {}
        in_row = _in_group(fact) and levels.get("row") != "alone"
        if in_row:
            rows[fact["group_id"]] = len(fact["members"])
        if levels.get("top") in ("ok", "partial"):  # a row's members all report its top
            delegates.add(fact["group_id"] if in_row else fact["peer_id"])
    return rows, delegates


def bandwidth_bound_bytes(row_sizes: Iterable[int], num_delegates: int, size: int) -> int:
    """The tensor bytes an epoch's group rounds must send at the least, over all its peers,
    in vectors of ``size`` float32 values (rows and delegates: :func:`rows_and_delegates`): a
    bandwidth-optimal all-reduce of ``n`` peers sends ``2 (n - 1)`` vectors in all (each peer
    ``2 (n - 1) / n``), for each row and for the delegates' top group; a row's spread is a
    broadcast from its delegate (members of weight 0 send no chunks: :mod:`averaging.spread`),
    a scatter and an all-gather, ``(n - 1)(1 + 1/n)`` vectors. Chunk headers and parts sent
    again are not in it."""
    row_sizes = list(row_sizes)
    row_vectors = sum(2 * (n - 1) for n in row_sizes)
    two_levels = num_delegates > 1
    top_vectors = 2 * (num_delegates - 1) if two_levels else 0
    spread_vectors = sum((n - 1) * (1 + 1 / n) for n in row_sizes) if two_levels else 0
    return round(4 * size * (row_vectors + top_vectors + spread_vectors))


def _spread(replicas: np.ndarray) -> float:
    """max_i ||x_i - mean|| / ||mean||, mean the plain mean of ``replicas``."""
    mean = replicas.mean(axis=0)
    return float(np.linalg.norm(replicas - mean, axis=1).max() / max(np.linalg.norm(mean), 1e-300))


def num_models(replicas: np.ndarray, rel_tol: float = SAME_MODEL_REL_TOL) -> int:
    """How many distinct models ``replicas`` hold: each replica within ``rel_tol`` (relative
    to its norm) of the first of a model is that model."""
    models: list[np.ndarray] = []
    for replica in replicas:
        scale = max(np.linalg.norm(replica), 1e-300)
        if not any(np.linalg.norm(replica - m) <= rel_tol * scale for m in models):
            models.append(replica)
    return len(models)


def _measured_epochs(facts: list[dict], config: dict[str, Any]) -> dict[int, list[dict]]:
    by_epoch: dict[int, list[dict]] = defaultdict(list)
    for fact in facts:
        by_epoch[fact["epoch"]].append(fact)
    epochs = sorted(e for e in by_epoch if e >= config["num_warmup_rounds"])
    if config["seconds"] is not None and epochs:
        epochs = epochs[:-1]  # the last one was cut by the stop
    return {e: by_epoch[e] for e in epochs}


def _over_bound(measured: list[dict], details: list[dict]) -> float | None:
    sent = sum(f["bytes_sent"] for f in measured)
    bound = sum(d["bandwidth_bound_bytes_per_peer"] * d["ready"] for d in details)
    return round(sent / bound, 3) if bound else None


def _node_rates(processes: list[dict]) -> list[float]:
    rates = []
    for process in processes:
        for node in process["nodes"]:
            moved = node["dht_sent_bytes"] + node["dht_recv_bytes"]
            rates.append(moved / max(process["wall_s"], 1e-9))
    return rates


def _rpc_rates(processes: list[dict], peer_seconds: float) -> dict[str, int]:
    """Body bytes per peer and second of each RPC (both sides), by name, busiest first."""
    totals: dict[str, int] = defaultdict(int)
    for process in processes:
        for name, moved in process["rpc_bytes"].items():
            totals[name] += moved
    return {n: round(b / peer_seconds) for n, b in sorted(totals.items(), key=lambda x: -x[1])}


def summarize(collected: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's JSON object (the contract fields are in docs/BENCHMARKS.md)."""
    num_peers, seed, size = config["num_peers"], config["seed"], config["size"]
    epochs = _measured_epochs(collected["round"], config)
    per_process = config["peers_per_process"]
    details = [epoch_detail(facts, seed, size, per_process) for facts in epochs.values()]
    measured = [fact for facts in epochs.values() for fact in facts]
    averaged = [fact for fact in measured if _in_group(fact)]
    processes = collected["process"]
    node_rates = _node_rates(processes)
    wall_s = max((p["wall_s"] for p in processes), default=0.0)
    num_peer_rounds = len(collected["round"])  # warm-up included: the CPU time covers them
    cpu_s = sum(p["cpu_s"] for p in processes)
    ends = [d["end_time"] for d in details]
    return {
        "peers": num_peers,
        "size": size,
        "rounds": len(details),
        "round_s_p50": _percentile([f["round_s"] for f in measured], 0.5),
        "round_s_p95": _percentile([f["round_s"] for f in measured], 0.95),
        "matchmaking_s_p50": _percentile([f["matchmaking_s"] for f in averaged], 0.5),
        "in_group_fraction": round(len(averaged) / len(measured), 4) if measured else None,
        "replica_spread": _largest(d["replica_spread"] for d in details),
        "replica_spread_p50": _percentile([d["replica_spread"] for d in details], 0.5),
        "exact_rel_err_max": _largest(d["exact_rel_err_max"] for d in details),
        "in_group_spread": _largest(
            d["in_group_spread"] for d in details if d["in_group_spread"] is not None
        ),
        "num_models_max": max((d["num_models"] for d in details), default=None),
        "bytes_sent_per_peer_per_round": (
            round(statistics.mean(f["bytes_sent"] for f in measured)) if measured else None
        ),
        # the same at the least the rounds' groups required (bandwidth_bound_bytes), and the
        # ratio of the two: chunk headers and parts sent again put it over 1, parts lost under
        "bandwidth_bound_bytes_per_peer_per_round": (
            round(statistics.mean(d["bandwidth_bound_bytes_per_peer"] for d in details))
            if details
            else None
        ),
        "bytes_sent_over_bound": _over_bound(measured, details),
        "dht_bytes_per_peer_per_s": round(statistics.mean(node_rates)) if node_rates else None,
        "median_node_dht_bytes_per_s": round(statistics.median(node_rates)) if node_rates else None,
        "max_node_dht_bytes_per_s": round(max(node_rates)) if node_rates else None,
        "matchmaking_bytes_per_peer_per_s": round(
            sum(n["matchmaking_bytes"] for p in processes for n in p["nodes"])
            / max(num_peers * wall_s, 1e-9)
        ),
        "rpc_bytes_per_peer_per_s": _rpc_rates(processes, num_peers * max(wall_s, 1e-9)),
        "cpu_s_per_peer_per_round": (
            round(cpu_s / num_peer_rounds, 4) if num_peer_rounds else None
        ),
        # per second as well as per round: on a full host rounds stretch, and a peer's steady
        # background work (progress, maintenance) is charged to fewer, longer rounds
        "cpu_s_per_peer_per_s": round(cpu_s / max(num_peers * wall_s, 1e-9), 5),
        "cpu_cores_used": round(cpu_s / max(wall_s, 1e-9), 2),
        "rss_mb_per_peer": round(
            sum(p["rss_peak_bytes"] for p in processes) / num_peers / 2**20, 1
        ),
        "epoch_s_p50": _percentile([b - a for a, b in itertools.pairwise(ends)], 0.5),
        "groups_per_round": [d["group_sizes"] for d in details],
        # searches under a key layout other than their epoch's most common one
        "layout_split_fraction": layout_split_fraction(d["layouts"] for d in details),
        "num_alone": sum(f["status"] == "alone" for f in measured),
        "num_failed": sum(f["status"] == "failed" for f in measured),
        "num_caught_up": len(collected["caught_up"]),
        "errors": [e["error"] for e in collected["error"]][:5],
        "timed_out": collected.get("timed_out", False),
        **_settings(config, len(processes)),
        "seconds": round(wall_s, 2),
        "round_details": [
            {
                k: (_significant(v) if isinstance(v, float) else v)
                for k, v in d.items()
                if k != "end_time"
            }
            for d in details
        ],
    }


def _settings(config: dict[str, Any], num_processes: int) -> dict[str, Any]:
    """The run's settings as the peers used them."""
    return {
        "step_group_hint": "expected_peers" if STEP_TAKES_EXPECTED_PEERS else "target_group_size",
        "processes": num_processes,
        "peers_per_process": config["peers_per_process"],
        "target_group_size": config["target_group_size"],
        "target_batch_size": config["batch_size"],
        "samples_per_s": config["samples_per_s"],
        "matchmaking_time_s": config["matchmaking_s"],
        "rpc_timeout_s": config["rpc_s"],
        "min_deadline_s": config.get("min_deadline"),
        "publish_interval_s": config.get("publish_interval_s"),
        "read_replicas": config.get("read_replicas"),
        "store_replicas": config.get("store_replicas"),
        "matchmaking_read_replicas": config.get("matchmaking_read_replicas"),
        "matchmaking_store_replicas": config.get("matchmaking_store_replicas"),
        "max_publish_gap_s": config.get("max_publish_gap_s"),
        "max_keys_read_per_interval": config.get("max_keys_read_per_interval"),
        "shared_address": config.get("shared_address"),
    }
