"""A process of ``peer bench swarm``: up to ``--peers-per-process`` light peers on one event loop.

Run as ``python -m peer.bench.swarm_child``; driven over stdin and stdout, one JSON object a
line. The parent sends the spec first (see :func:`peer_spec`); the child starts its peers and
answers ``{"type": "hello", "addresses": [...]}``. On ``{"cmd": "go"}`` the peers start
training; each round is one ``{"type": "round", ...}`` line (see
:meth:`SwarmPeer.round_fact`), a peer that finished its epochs one ``{"type": "done"}``. On
``{"cmd": "stop"}`` (or end of input) the child stops its peers, answers with its process facts
(``{"type": "process", ...}``: CPU seconds, peak RSS, each node's DHT bytes, all since the go)
and exits. The peers share nothing but the network: each has its own keys, port and DHT node.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time
from typing import Any

from averaging.config import AveragerConfig
from dht.gc_policy import settle as settle_gc
from peer.bench.swarm_peer import PeerSpec, SwarmPeer
from peer.swarm.progress import ProgressConfig

# How many peers of a process join the DHT at once (all at once would send every join to the
# bootstrap nodes in the same instant).
STARTS_AT_ONCE = 8
STATUS_INTERVAL_S = 30.0  # a status line to the parent this often


def peer_spec(message: dict[str, Any]) -> PeerSpec:
    """The shared spec from the parent's first message."""
    return PeerSpec(
        size=message["size"],
        seed=message["seed"],
        last_epoch=message["last_epoch"],
        samples_per_s=message["samples_per_s"],
        step_s=message["step_s"],
        progress=ProgressConfig(**message["progress"]),
        averager=AveragerConfig(**message["averager"]),
        step_timeout_s=message["step_timeout_s"],
        rpc_timeout_s=message["rpc_timeout_s"],
        bootstrap_timeout_s=message["bootstrap_timeout_s"],
        shared_address=message["shared_address"],
    )


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _receive() -> dict[str, Any] | None:
    line = await asyncio.to_thread(sys.stdin.readline)
    return json.loads(line) if line.strip() else None


async def _start_all(peers: list[SwarmPeer]) -> None:
    for first in range(0, len(peers), STARTS_AT_ONCE):
        await asyncio.gather(*(p.start() for p in peers[first : first + STARTS_AT_ONCE]))


async def _run_peer(peer: SwarmPeer) -> None:
    await peer.run(_send)
    _send({"type": "done", "rank": peer.rank})


def _status(peers: list[SwarmPeer]) -> dict[str, Any]:
    """Where this process's peers are: epochs, and what their estimates see (a long run shows
    why it does not move: e.g. peers that see few others never reach the target)."""
    estimates = [p.last_estimate for p in peers if p.last_estimate is not None]
    epochs: dict[int, int] = {}
    for peer in peers:
        epochs[peer.epoch] = epochs.get(peer.epoch, 0) + 1
    return {
        "type": "status",
        "index": peers[0].rank,  # the process's first rank names it
        "epochs": epochs,
        "peers_seen": [e.num_peers for e in estimates],
        "target_fraction": [
            round(e.samples_accumulated / e.target_batch_size, 3) for e in estimates
        ],
    }


async def _send_status(peers: list[SwarmPeer]) -> None:
    while True:
        await asyncio.sleep(STATUS_INTERVAL_S)
        _send(_status(peers))


def _process_facts(peers: list[SwarmPeer], since: dict[str, Any]) -> dict[str, Any]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    by_rpc: dict[str, int] = {}
    for peer, before in zip(peers, since["rpc"], strict=True):
        for name, moved in peer.rpc_bytes().items():
            by_rpc[name] = by_rpc.get(name, 0) + moved - before.get(name, 0)
    nodes = []
    for peer, (sent0, recv0), mm0 in zip(peers, since["dht"], since["mm"], strict=True):
        sent, recv = peer.dht_bytes()
        nodes.append(
            {
                "rank": peer.rank,
                "dht_sent_bytes": sent - sent0,
                "dht_recv_bytes": recv - recv0,
                "matchmaking_bytes": peer.matchmaking_bytes() - mm0,
            }
        )
    return {
        "type": "process",
        "cpu_s": time.process_time() - since["cpu_s"],
        "wall_s": time.monotonic() - since["wall_s"],
        "rss_peak_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "nodes": nodes,
        "rpc_bytes": by_rpc,
    }


async def main() -> None:
    message = await _receive()
    if message is None:
        return
    spec, ranks = peer_spec(message), message["ranks"]
    peers: list[SwarmPeer] = []
    try:
        initial_peers = message["initial_peers"]
        if not initial_peers:  # the first process: its first peer bootstraps the others
            peers.append(SwarmPeer(ranks[0], spec, []))
            await peers[0].start()
            initial_peers = [peers[0].transport.address]
        more = [SwarmPeer(rank, spec, initial_peers) for rank in ranks[len(peers) :]]
        peers += more
        await _start_all(more)
        settle_gc()  # started: the collector's policy for the run (dht.gc_policy)
        _send({"type": "hello", "addresses": [p.transport.address for p in peers]})
        command = await _receive()
        if command is None or command.get("cmd") != "go":
            return
        since = {
            "cpu_s": time.process_time(),
            "wall_s": time.monotonic(),
            "dht": [p.dht_bytes() for p in peers],
            "mm": [p.matchmaking_bytes() for p in peers],
            "rpc": [p.rpc_bytes() for p in peers],
        }
        tasks = [asyncio.create_task(_run_peer(p)) for p in peers]
        status = asyncio.create_task(_send_status(peers))
        try:
            await _receive()  # stop, or the parent is gone
            facts = _process_facts(peers, since)
        finally:
            for task in [*tasks, status]:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(status, return_exceptions=True)
        for peer, outcome in zip(peers, results, strict=True):
            if isinstance(outcome, Exception):
                _send({"type": "error", "rank": peer.rank, "error": repr(outcome)})
        _send(facts)
    finally:
        await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(created).3f swarm-child %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger().setLevel(sys.argv[1] if len(sys.argv) > 1 else "ERROR")
    asyncio.run(main())
