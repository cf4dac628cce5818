"""The hivemind side of the benchmarks: ``peer bench allreduce --backend hivemind`` and
``peer bench dht --backend hivemind``, with the same workloads and contract fields as the native
ones (:mod:`averaging.bench.allreduce`, :mod:`dht.tools.bench`).

All-reduce: N processes (spawned; each starts its own hivemind.DHT, which forks a DHT process and
a p2pd daemon, and a hivemind DecentralizedAverager, another process) draw the same random
vectors and weights as the native benchmark every round, meet at a barrier, and call
``averager.step``. A round counts in ``rounds`` if its group was complete and, on the peer that
checks it against the exact mean, its error is within the wire format's rounding. A round's
matchmaking lasts until its StepControl says the all-reduce began
(polled every millisecond); the all-reduce from then until the step returns. ``bytes_sent_per_peer``
is the butterfly's payload, 2 (n-1)/n of the compressed vector (hivemind does not count bytes).

DHT: N hivemind.DHT nodes started from this process, values stored from random nodes and read from
others, as in :mod:`dht.tools.bench`; ``rss_mb`` sums the resident memory of this process and all
its descendants (the DHT processes and their p2pd daemons), ``pss_mb`` their proportional memory.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import random
import statistics
import time
import traceback
from typing import Any

import numpy as np
import psutil

from averaging.bench.allreduce import _exact_mean, _values
from averaging.bench.processes import contract_summary, run_peer_processes
from peer.bench.processes import tree_memory_bytes
from peer.hivemind.hook import BYTES_PER_VALUE, AllreduceWatch, hivemind_compression
from peer.hivemind.hook import import_hivemind as _import_hivemind

logger = logging.getLogger(__name__)
_PREFIX = "bench"
_BARRIER_TIMEOUT_S = 180.0
_STARTUP_TIMEOUT_S = 120.0
_ROUND_TIMEOUT_S = 120.0
EXPIRATION_S = 600.0
# Largest error of a correct round per wire format, for values in [-1, 1]: float32 rounding,
# fp16 rounding (2^-11 relative), 8-bit quantization of a [-1, 1] range (about 1/128), each with
# a margin.
MAX_ABS_ERR = {"none": 1e-5, "fp16": 5e-3, "uint8": 0.1}


def _worker(rank: int, spec: dict[str, Any], barrier, results) -> None:
    logging.basicConfig(level=logging.WARNING)
    # this process was spawned, which makes spawn its default; hivemind's averager must fork
    mp.set_start_method("fork", force=True)
    try:
        _peer(rank, spec, barrier, results)
    except BaseException as e:  # report (with where it happened), then let the process die
        where = traceback.extract_tb(e.__traceback__)[-1]
        results.put(("error", rank, f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})"))
        raise


def _peer(rank: int, spec: dict[str, Any], barrier, results) -> None:
    import torch

    hivemind = _import_hivemind()
    torch.set_num_threads(1)
    num_peers, size = spec["num_peers"], spec["size"]
    dht = hivemind.DHT(initial_peers=spec["initial_peers"] or None, start=True)
    results.put(("address", rank, [str(a) for a in dht.get_visible_maddrs()]))
    averager = hivemind.averaging.DecentralizedAverager(
        [torch.zeros(size)],
        dht=dht,
        prefix=_PREFIX,
        target_group_size=num_peers,
        min_group_size=num_peers,
        compression=hivemind_compression(spec["compression"]),
        start=True,
    )
    try:
        for round_index in range(spec["num_warmup"] + spec["num_rounds"]):
            values, weight = _values(spec["seed"], rank, round_index, size)
            with averager.get_tensors() as tensors:
                tensors[0].copy_(torch.from_numpy(values))
            barrier.wait(_BARRIER_TIMEOUT_S)
            start = time.perf_counter()
            control = averager.step(weight=weight, wait=False, timeout=_ROUND_TIMEOUT_S)
            watch = AllreduceWatch(control)
            status = "ok"
            try:
                group = control.result(_ROUND_TIMEOUT_S)
                status = "ok" if group is not None and len(group) == num_peers else "partial"
            except Exception as e:
                status = f"failed: {type(e).__name__}"
            began_s = watch.stop()
            end = time.perf_counter()
            if round_index < spec["num_warmup"]:
                continue
            began_s = end if began_s is None else max(began_s, start)
            max_abs_err = None
            if round_index % num_peers == rank:
                exact = _exact_mean(spec["seed"], num_peers, round_index, size)
                with averager.get_tensors() as tensors:
                    max_abs_err = float(np.max(np.abs(tensors[0].numpy() - exact)))
                if status == "ok" and max_abs_err > MAX_ABS_ERR[spec["compression"]]:
                    # hivemind reports a round whose reducers lost parts as done; the result
                    # tells: such a round does not count in ``rounds``
                    status = "wrong result"
            results.put(
                (
                    "round",
                    rank,
                    {
                        "round": round_index,
                        "status": status,
                        "round_s": end - start,
                        "allreduce_s": end - began_s,
                        "matchmaking_s": began_s - start,
                        "max_abs_err": max_abs_err,
                    },
                )
            )
        barrier.wait(_BARRIER_TIMEOUT_S)  # others may still be reducing our part
    finally:
        averager.shutdown()
        dht.shutdown()


def run_hivemind_allreduce_bench(
    num_peers: int,
    size: int,
    compression: str = "none",
    num_rounds: int = 5,
    *,
    num_warmup: int = 1,
    seed: int = 0,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """The hivemind twin of :func:`averaging.bench.allreduce.run_allreduce_bench`; same contract
    fields.

    Raises:
        ValueError: bad arguments.
        ConfigError: hivemind is not installed.
        RuntimeError: a peer process failed or the run exceeded ``timeout_s``.
    """
    if num_peers < 2 or size < 1 or num_rounds < 1 or num_warmup < 0:
        raise ValueError("need num_peers >= 2, size >= 1, num_rounds >= 1, num_warmup >= 0")
    _import_hivemind()
    hivemind_compression(compression)  # refuse an unknown name before starting processes
    spec = {
        "num_peers": num_peers,
        "size": size,
        "num_rounds": num_rounds,
        "num_warmup": num_warmup,
        "seed": seed,
        "compression": compression,
        "initial_peers": [],
    }
    rounds = run_peer_processes(
        _worker,
        spec,
        num_peers=num_peers,
        num_rounds=num_rounds,
        timeout_s=timeout_s,
        startup_timeout_s=_STARTUP_TIMEOUT_S,
        initial_peers=lambda address: address,
    )
    return _summary(rounds, num_peers, size, compression)


def _summary(rounds, num_peers: int, size: int, compression: str) -> dict[str, Any]:
    return contract_summary(
        rounds,
        backend="hivemind",
        num_peers=num_peers,
        size=size,
        compression=compression,
        bytes_sent_per_peer=int(
            2 * (num_peers - 1) / num_peers * size * BYTES_PER_VALUE[compression]
        ),
    )


def _percentile_ms(samples_s: list[float], fraction: float) -> float:
    ordered = sorted(samples_s)
    index = min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))
    return round(ordered[index] * 1000, 3)


def run_hivemind_dht_bench(*, num_nodes: int, num_keys: int, seed: int = 0) -> dict[str, Any]:
    """The hivemind twin of :func:`dht.tools.bench.run_dht_bench`; same contract fields."""
    hivemind = _import_hivemind()
    from hivemind.utils import get_dht_time

    rng = random.Random(seed)
    me = psutil.Process()
    rss_before, _ = tree_memory_bytes(me)
    nodes: list[Any] = []
    try:
        bootstrap_s = []
        for _ in range(num_nodes):
            initial = [str(a) for a in rng.choice(nodes).get_visible_maddrs()] if nodes else None
            start = time.perf_counter()
            nodes.append(hivemind.DHT(initial_peers=initial, start=True))
            if len(nodes) > 1:
                bootstrap_s.append(time.perf_counter() - start)
        writers, store_s, num_stored = [], [], 0
        for index in range(num_keys):
            writer = rng.choice(nodes)
            writers.append(writer)
            start = time.perf_counter()
            ok = writer.store(f"bench/{seed}/{index}", {"index": index}, get_dht_time() + 600)
            store_s.append(time.perf_counter() - start)
            num_stored += bool(ok)
        get_s, num_found = [], 0
        for index, writer in enumerate(writers):
            reader = rng.choice([n for n in nodes if n is not writer] or nodes)
            start = time.perf_counter()
            found = reader.get(f"bench/{seed}/{index}")
            get_s.append(time.perf_counter() - start)
            num_found += found is not None and found.value == {"index": index}
        rss, pss = tree_memory_bytes(me)
    finally:
        for node in nodes:
            node.shutdown()
    return {
        "nodes": num_nodes,
        "store_ok": round(num_stored / num_keys, 4),
        "get_ok": round(num_found / num_keys, 4),
        "get_p50_ms": _percentile_ms(get_s, 0.5),
        "get_p99_ms": _percentile_ms(get_s, 0.99),
        "store_p50_ms": _percentile_ms(store_s, 0.5),
        "bootstrap_s": round(statistics.median(bootstrap_s), 4) if bootstrap_s else 0.0,
        "rss_mb": round(rss / 2**20, 1),
        "rss_mb_per_node": round((rss - rss_before) / 2**20 / num_nodes, 2),
        "pss_mb": round(pss / 2**20, 1),
    }
