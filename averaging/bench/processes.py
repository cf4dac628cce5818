"""The process harness of the all-reduce benchmarks (ours and hivemind's twin): N peer
processes, the first one's address everyone's initial peer, a barrier per round, and each
round's per-peer results collected through a queue under one deadline."""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable
from typing import Any

# A peer process: (rank, spec, barrier, results queue) -> None; it puts ("address", rank,
# address) once it serves, ("round", rank, {...}) per round, or ("error", rank, text).
Worker = Callable[[int, dict[str, Any], Any, Any], None]


def run_peer_processes(
    worker: Worker,
    spec: dict[str, Any],
    *,
    num_peers: int,
    num_rounds: int,
    timeout_s: float,
    startup_timeout_s: float,
    initial_peers: Callable[[Any], Any] = lambda address: [address],
) -> list[list[dict]]:
    """Run the peers to the end; each round's results (one dict per peer), in round order.

    Raises:
        RuntimeError: a peer process failed, went silent, or the run exceeded ``timeout_s``.
    """
    context = mp.get_context("spawn")
    barrier = context.Barrier(num_peers)
    results = context.Queue()
    processes = []
    deadline = time.monotonic() + timeout_s

    def next_message() -> tuple:
        wait_s = max(0.1, min(startup_timeout_s, deadline - time.monotonic()))
        try:
            return results.get(timeout=wait_s)
        except queue.Empty:
            raise RuntimeError("benchmark peers stopped answering") from None

    try:
        processes.append(context.Process(target=worker, args=(0, spec, barrier, results)))
        processes[0].start()
        kind, rank, address = next_message()
        if kind != "address":
            raise RuntimeError(f"peer {rank} failed to start: {address}")
        spec = {**spec, "initial_peers": initial_peers(address)}
        for rank in range(1, num_peers):
            processes.append(context.Process(target=worker, args=(rank, spec, barrier, results)))
            processes[-1].start()
        rounds: dict[int, list[dict]] = {}
        received = 0
        while received < num_peers * num_rounds:
            if time.monotonic() > deadline:
                raise RuntimeError("allreduce benchmark timed out")
            kind, rank, payload = next_message()
            if kind == "error":
                raise RuntimeError(f"peer {rank} failed: {payload}")
            if kind == "round":
                rounds.setdefault(payload["round"], []).append(payload)
                received += 1
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [rounds[r] for r in sorted(rounds)]


def contract_summary(
    rounds: list[list[dict]],
    *,
    backend: str,
    num_peers: int,
    size: int,
    compression: str,
    bytes_sent_per_peer: int,
) -> dict[str, Any]:
    """The ``allreduce`` contract fields of DESIGN.md from each round's per-peer results (a
    round takes as long as its slowest peer)."""

    def p50_of_slowest(field: str) -> float:
        return statistics.median(max(peer[field] for peer in peers) for peers in rounds)

    allreduce_s = p50_of_slowest("allreduce_s")
    errors = [peer["max_abs_err"] for peers in rounds for peer in peers]
    return {
        "backend": backend,
        "peers": num_peers,
        "size": size,
        "compression": compression,
        "rounds": sum(all(peer["status"] == "ok" for peer in peers) for peers in rounds),
        "round_s_p50": round(p50_of_slowest("round_s"), 4),
        "allreduce_s_p50": round(allreduce_s, 4),
        "matchmaking_s_p50": round(p50_of_slowest("matchmaking_s"), 4),
        "max_abs_err": max((e for e in errors if e is not None), default=None),
        "bytes_sent_per_peer": bytes_sent_per_peer,
        "gbit_per_s": (
            round(bytes_sent_per_peer * 8 / allreduce_s / 1e9, 3) if allreduce_s else 0.0
        ),
    }
