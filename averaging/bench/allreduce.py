"""``peer bench allreduce``: N real peer processes on loopback average random vectors.

Each peer is its own process (started with multiprocessing's spawn; the harness only, the peers
talk over HTTP) with its own transport, DHT node and averager. Every round, each peer draws
``size`` random float32 values and a random weight, all peers meet at a barrier, and each one
runs :meth:`DecentralizedAverager.step` (matchmaking included). One peer per round (in turn)
checks its result against the exact weighted mean computed in float64 from every peer's values.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from averaging.averager import DecentralizedAverager
from averaging.bench.processes import contract_summary, run_peer_processes
from averaging.config import AveragerConfig
from averaging.rules.compression import Compression
from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig

logger = logging.getLogger(__name__)

_PREFIX = "bench"
_BARRIER_TIMEOUT_S = 120.0
_STARTUP_TIMEOUT_S = 60.0


def _values(seed: int, rank: int, round_index: int, size: int) -> tuple[np.ndarray, float]:
    rng = np.random.default_rng([seed, rank, round_index])
    weight = float(rng.uniform(0.5, 2.0))
    values = rng.random(size, dtype=np.float32)
    values *= 2.0
    values -= 1.0
    return values, weight


def _exact_mean(seed: int, num_peers: int, round_index: int, size: int) -> np.ndarray:
    total = np.zeros(size, dtype=np.float64)
    weight_sum = 0.0
    for rank in range(num_peers):
        values, weight = _values(seed, rank, round_index, size)
        total += values.astype(np.float64) * weight
        weight_sum += weight
    total /= weight_sum
    return total


async def _peer(rank: int, spec: dict[str, Any], barrier, results) -> None:
    identity = PeerIdentity.generate()
    places = spec.get("places")
    host = places[rank][1] if places else TransportConfig.host
    transport = HttpTransport(identity, TransportConfig(host=host))
    node = DHTNode(
        transport=transport,
        identity=identity,
        config=DHTConfig(initial_peers=spec["initial_peers"]),
    )
    tensor = np.zeros(spec["size"], dtype=np.float32)
    averager = DecentralizedAverager(
        [tensor], transport=transport, dht=node, prefix=_PREFIX, config=spec["config"]
    )
    async with transport, node, averager:
        results.put(("address", rank, transport.address))
        num_peers, size = spec["num_peers"], spec["size"]
        for round_index in range(spec["num_warmup"] + spec["num_rounds"]):
            values, weight = _values(spec["seed"], rank, round_index, size)
            tensor[:] = values
            await asyncio.to_thread(barrier.wait, _BARRIER_TIMEOUT_S)
            start = time.perf_counter()
            result = await averager.step(weight=weight, epoch=round_index)
            round_s = time.perf_counter() - start
            measured = round_index >= spec["num_warmup"]
            max_abs_err = None
            if measured and round_index % num_peers == rank:
                exact = _exact_mean(spec["seed"], num_peers, round_index, size)
                max_abs_err = float(np.max(np.abs(tensor - exact)))
            if measured:
                results.put(
                    (
                        "round",
                        rank,
                        {
                            "round": round_index,
                            "status": result.status,
                            "round_s": round_s,
                            "allreduce_s": result.allreduce_s,
                            "matchmaking_s": result.matchmaking_s,
                            "bytes_sent": result.bytes_sent,
                            "max_abs_err": max_abs_err,
                            "phase_s": dict(result.phase_s),
                            "deadlines_s": dict(result.deadlines_s),
                            "num_streams": result.num_streams,
                        },
                    )
                )
        # Stay reachable until everyone is done: others may still be reducing our part.
        await asyncio.to_thread(barrier.wait, _BARRIER_TIMEOUT_S)


def _worker(rank: int, spec: dict[str, Any], barrier, results) -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(created).4f peer {rank} %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("averaging").setLevel(spec["log_level"])
    try:
        if spec.get("places"):
            spec["places"][rank][0]()  # into this peer's network before any socket exists
        asyncio.run(_peer(rank, spec, barrier, results))
    except BaseException as e:  # report, then let the process die
        results.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise


def run_allreduce_bench(
    num_peers: int,
    size: int,
    compression: str = "none",
    num_rounds: int = 5,
    *,
    num_warmup: int = 1,
    seed: int = 0,
    config: AveragerConfig | None = None,
    include_phases: bool = False,
    timeout_s: float = 600.0,
    log_level: str = "WARNING",
    places: list[tuple[Callable[[], None], str]] | None = None,
    aggregation: str = "mean",
    include_rounds: bool = False,
    streams_per_pair: int = 0,
) -> dict[str, Any]:
    """Run ``num_rounds`` measured rounds (after ``num_warmup``) of ``num_peers`` processes.

    Returns the contract fields of DESIGN.md: ``backend`` ("native"), ``peers``, ``size``,
    ``compression``, ``rounds`` (measured rounds in which every peer averaged fully),
    ``round_s_p50`` / ``allreduce_s_p50`` / ``matchmaking_s_p50`` (median over rounds of the
    slowest peer's seconds: a round is over when its last peer is done), ``max_abs_err`` (against
    the exact weighted mean in float64), ``bytes_sent_per_peer`` (tensor bytes one peer sends in
    one all-reduce, mean) and ``gbit_per_s`` (those bytes over ``allreduce_s_p50``). With
    ``include_phases``, also ``phases_s_p50``: median seconds per phase (see RoundResult.phase_s).

    Every peer uses ``config`` (default: groups of exactly ``num_peers``, the given compression,
    the other settings at their defaults); ``log_level`` is the peers' ``averaging`` log level
    (their log lines go to stderr with wall-clock timestamps, for cross-process timelines).
    ``places`` (one per peer, picklable): a function the peer's process calls first (e.g. to move
    into a network namespace) and the address it listens on; default: all on 127.0.0.1.
    ``aggregation`` picks the reducers' rule (:mod:`averaging.rules.robust`; the summary says which,
    and ``max_abs_err`` stays against the weighted mean, which a robust rule departs from).
    ``deadlines_s``: the waits of the last round (the longest over peers; see
    :mod:`averaging.allreduce.deadlines`). With ``include_rounds``, also ``round_details``: per
    measured round, each peer's status, the checked peer's ``max_abs_err``, its ``deadlines_s``, the
    streams per pair (``num_streams``) and the slowest peer's ``allreduce_s``. ``streams_per_pair``
    goes into the default config (0: chosen from the measured RTT and past goodput, see
    :mod:`averaging.allreduce.streams`); ``streams_per_pair`` in the result is the median over
    measured rounds of the number the groups used.

    Raises:
        ValueError: bad arguments.
        RuntimeError: a peer process failed or the run exceeded ``timeout_s``.
    """
    if num_peers < 2 or size < 1 or num_rounds < 1 or num_warmup < 0:
        raise ValueError("need num_peers >= 2, size >= 1, num_rounds >= 1, num_warmup >= 0")
    if places is not None and len(places) != num_peers:
        raise ValueError(f"places: need one per peer ({num_peers}), got {len(places)}")
    compression = Compression(compression).value
    config = config or AveragerConfig(
        target_group_size=num_peers,
        min_group_size=num_peers,
        compression=compression,
        aggregation=aggregation,
        streams_per_pair=streams_per_pair,
    )
    spec = {
        "num_peers": num_peers,
        "size": size,
        "num_rounds": num_rounds,
        "num_warmup": num_warmup,
        "seed": seed,
        "config": config,
        "initial_peers": [],
        "log_level": log_level,
        "places": places,
    }
    rounds = run_peer_processes(
        _worker,
        spec,
        num_peers=num_peers,
        num_rounds=num_rounds,
        timeout_s=timeout_s,
        startup_timeout_s=_STARTUP_TIMEOUT_S,
    )
    summary = _summary(rounds, num_peers, size, compression, include_phases)
    summary["deadlines_s"] = {
        k: round(v, 3) for k, v in sorted(_round_detail(rounds[-1])["deadlines_s"].items())
    }
    summary["streams_per_pair"] = statistics.median_low(
        peer["num_streams"] for peers in rounds for peer in peers
    )
    if include_rounds:
        summary["round_details"] = [_round_detail(peers) for peers in rounds]
    if config.aggregation.value != "mean":  # an extra field only when asked for
        summary["aggregation"] = config.aggregation.value
    return summary


def _round_detail(peers: list[dict]) -> dict[str, Any]:
    errors = [peer["max_abs_err"] for peer in peers if peer["max_abs_err"] is not None]
    waits = {name for peer in peers for name in peer["deadlines_s"]}
    return {
        "statuses": sorted(peer["status"] for peer in peers),
        "max_abs_err": max(errors, default=None),
        "deadlines_s": {k: max(peer["deadlines_s"].get(k, 0.0) for peer in peers) for k in waits},
        "num_streams": max(peer["num_streams"] for peer in peers),
        "allreduce_s": max(peer["allreduce_s"] for peer in peers),
    }


def _summary(rounds, num_peers, size, compression, include_phases) -> dict[str, Any]:
    bytes_sent = statistics.mean(peer["bytes_sent"] for peers in rounds for peer in peers)
    summary = contract_summary(
        rounds,
        backend="native",
        num_peers=num_peers,
        size=size,
        compression=compression,
        bytes_sent_per_peer=int(bytes_sent),
    )
    if include_phases:
        phases = {k for peers in rounds for peer in peers for k in peer["phase_s"]}
        summary["phases_s_p50"] = {
            k: round(
                statistics.median(peer["phase_s"].get(k, 0.0) for ps in rounds for peer in ps), 4
            )
            for k in sorted(phases)
        }
    return summary
