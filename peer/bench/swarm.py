"""``peer bench swarm``: N light peers running the real DHT, progress tracker and averager.

Each peer (:mod:`peer.bench.swarm_peer`) has its own keys, transport port on 127.0.0.1 and DHT
node; they are packed ``peers_per_process`` to a process (:mod:`peer.bench.swarm_child`, one
event loop each) and share nothing but the network. Training is a stand-in: samples accumulate
at each peer's rate toward the target batch size, and each epoch's "gradient" is a seeded random
vector, so that the parent can check every averaged replica against the exact weighted mean in
float64 (:mod:`peer.bench.swarm_summary`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from averaging.config import AveragerConfig
from dht.kademlia.config import read_replicas_problem, store_replicas_problem
from peer.bench.swarm_summary import summarize
from peer.swarm.progress_config import progress_default

_REPO_ROOT = Path(__file__).resolve().parents[2]
_NUM_INITIAL_PEERS = 4  # a process's peers join through this many peers started before
_LINE_LIMIT_BYTES = 2**26  # a round line carries the replica (base64 float32)
_STOP_TIMEOUT_S = 60.0  # a child answers "stop" with its facts within this
_STATUS_INTERVAL_S = 30.0  # a line on stderr this often while the peers run
TOP_ROUND_TIMEOUT_S = AveragerConfig().top_round_timeout_s  # the peers' (the default)


@dataclass(frozen=True, kw_only=True)
class SwarmBenchConfig:
    """One run of ``peer bench swarm``.

    Attributes:
        num_peers: peers in the swarm (>= 2).
        size: float32 values each peer averages per round.
        num_rounds: epochs measured after the warm-up ones; ignored with ``seconds``.
        seconds: run for this long after the warm-up start instead (None: ``num_rounds``).
        num_warmup_rounds: first epochs not measured (the DHT and progress records are cold).
        peers_per_process: peers sharing one process and event loop.
        target_group_size: the averager's largest group.
        samples_per_s: a peer's mean rate (each is 0.5x to 1.5x of it).
        target_batch_size: samples per epoch across the swarm (None: ``epoch_s`` worth of the
            swarm's summed rate).
        epoch_s: the epoch length the default target batch size aims at, in seconds.
        step_s: one local step, in seconds (the peer reads the swarm's estimate after each).
        publish_interval_s: how often a peer publishes and reads progress, in seconds.
        read_replicas: ``ProgressConfig.read_replicas`` (None: every replica merged).
        store_replicas: ``ProgressConfig.store_replicas`` (None: every replica written).
        matchmaking_read_replicas: ``AveragerConfig.read_replicas`` (None: every replica
            merged).
        matchmaking_store_replicas: ``AveragerConfig.store_replicas`` (None: every replica
            written).
        max_keys_read_per_interval: ``ProgressConfig.max_keys_read_per_interval`` (None: every
            interval reads its keys, however many).
        max_publish_gap_s: ``ProgressConfig.max_publish_gap_s`` (None: a record stored every
            interval).
        matchmaking_time_s: the averager's bound on looking for a group, in seconds (None: 5,
            and num_peers / 5 above 25 peers: on one host every DHT request of the swarm
            shares its cores; at 64 peers on 2 cores the announce and the first read of the
            matchmaking key took about 3 s each, and 5 s formed no group at all).
        allreduce_timeout_s: the averager's bound on one all-reduce, in seconds.
        min_deadline_s: the floor of the averager's adaptive waits (a sender's connection, a
            reducer's next chunk), in seconds (None: 1, and num_peers / 32 above 32 peers: one
            host's cores connect the senders of every group at once; at 64 peers on 2 cores,
            10 to 26 of 64 rounds per epoch lost a sender not connected within 1 s).
        rpc_timeout_s: bound on one DHT request, in seconds (None: 5, and num_peers / 16 above
            80 peers).
        seed: seeds the peers' rates and vectors.
        shared_address: every peer on 127.0.0.1 (before 2026-11-28, every run): the whole
            swarm is one source address to each node's limits per address (64 streams, 200
            requests and 20 accepted connections per second, ...), which the internet's
            peers, each on its own address, never meet together. By default each peer has an
            address of its own on loopback (``127.1.x.y``, bound for listening and as the
            source of its connections).
        timeout_s: bound on the whole run, in seconds (None: from the other settings).
        log_level: the peers' log level (their lines go to stderr).
    """

    num_peers: int
    size: int = 1000
    num_rounds: int = 5
    seconds: float | None = None
    num_warmup_rounds: int = 1
    peers_per_process: int = 32
    target_group_size: int = 16
    samples_per_s: float = 32.0
    target_batch_size: int | None = None
    epoch_s: float = 8.0
    step_s: float = 0.5
    publish_interval_s: float = 2.0
    read_replicas: int | None = progress_default("read_replicas")
    store_replicas: int | None = progress_default("store_replicas")
    matchmaking_read_replicas: int | None = AveragerConfig().read_replicas
    matchmaking_store_replicas: int | None = AveragerConfig().store_replicas
    max_publish_gap_s: float | None = progress_default("max_publish_gap_s")
    max_keys_read_per_interval: int | None = progress_default("max_keys_read_per_interval")
    matchmaking_time_s: float | None = None
    allreduce_timeout_s: float = 30.0
    min_deadline_s: float | None = None
    rpc_timeout_s: float | None = None
    seed: int = 0
    shared_address: bool = False
    timeout_s: float | None = None
    log_level: str = "ERROR"

    def __post_init__(self) -> None:
        if self.num_peers < 2:
            raise ValueError(f"num_peers must be >= 2, got {self.num_peers}")
        if self.target_group_size < 2:
            raise ValueError(f"target_group_size must be >= 2, got {self.target_group_size}")
        for name in ("size", "num_rounds", "peers_per_process"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_warmup_rounds < 0:
            raise ValueError(f"num_warmup_rounds must be >= 0, got {self.num_warmup_rounds}")
        for name in ("samples_per_s", "epoch_s", "step_s", "publish_interval_s",
                     "allreduce_timeout_s"):  # fmt: skip
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        for name in ("seconds", "matchmaking_time_s", "min_deadline_s", "rpc_timeout_s",
                     "timeout_s", "max_publish_gap_s", "max_keys_read_per_interval"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number, got {value}")
        for name in ("read_replicas", "store_replicas", "matchmaking_read_replicas",
                     "matchmaking_store_replicas"):  # fmt: skip
            if problem := read_replicas_problem(getattr(self, name)):
                raise ValueError(f"{name} {problem}")
        pairs = (("store_replicas", "read_replicas"),
                 ("matchmaking_store_replicas", "matchmaking_read_replicas"))  # fmt: skip
        for store, read in pairs:
            if problem := store_replicas_problem(getattr(self, store), getattr(self, read)):
                raise ValueError(f"{store} {problem}")
        if self.target_batch_size is not None and self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be >= 1, got {self.target_batch_size}")

    @property
    def batch_size(self) -> int:
        """The target batch size used: given, or ``epoch_s`` of the swarm's summed rate."""
        if self.target_batch_size is not None:
            return self.target_batch_size
        return max(1, round(self.num_peers * self.samples_per_s * self.epoch_s))

    @property
    def matchmaking_s(self) -> float:
        """The matchmaking time used (given, or scaled with the swarm)."""
        if self.matchmaking_time_s is not None:
            return self.matchmaking_time_s
        return max(5.0, self.num_peers / 5)

    @property
    def min_deadline(self) -> float:
        """The floor of the adaptive waits used (given, or scaled with the swarm)."""
        if self.min_deadline_s is not None:
            return self.min_deadline_s
        return max(1.0, self.num_peers / 32)

    @property
    def rpc_s(self) -> float:
        """The DHT request timeout used (given, or scaled with the swarm)."""
        return (
            self.rpc_timeout_s if self.rpc_timeout_s is not None else max(5.0, self.num_peers / 16)
        )

    @property
    def step_timeout_s(self) -> float:
        """Bound on one averaging step: matchmaking and an all-reduce, and when the swarm does
        not fit one group, the second level's round and spread too (as the averager's default;
        without them the delegates' top round was squeezed into what the rows left)."""
        step_s = self.matchmaking_s + self.allreduce_timeout_s
        if self.num_peers > self.target_group_size:
            step_s += TOP_ROUND_TIMEOUT_S + self.allreduce_timeout_s
        return step_s

    @property
    def num_processes(self) -> int:
        return math.ceil(self.num_peers / self.peers_per_process)

    def run_timeout_s(self) -> float:
        """The whole run's bound: start-up, then the epochs with generous slack."""
        if self.timeout_s is not None:
            return self.timeout_s
        startup_s = 60.0 + 0.5 * self.num_peers
        epoch_s = self.batch_size / (self.num_peers * self.samples_per_s)
        round_s = self.step_timeout_s
        if self.seconds is not None:
            return startup_s + self.seconds + round_s + 60.0
        num_epochs = self.num_rounds + self.num_warmup_rounds
        return startup_s + num_epochs * (3 * epoch_s + round_s) + 60.0

    def child_spec(self) -> dict[str, Any]:
        """The spec every child gets (ranks and initial peers added per child)."""
        last_epoch = None if self.seconds is not None else self.num_rounds + self.num_warmup_rounds
        return {
            "size": self.size,
            "seed": self.seed,
            "last_epoch": last_epoch,
            "samples_per_s": self.samples_per_s,
            "step_s": self.step_s,
            "progress": {
                "target_batch_size": self.batch_size,
                "publish_interval_s": self.publish_interval_s,
                "record_ttl_s": max(10 * self.publish_interval_s, 20.0),
                "read_replicas": self.read_replicas,
                "store_replicas": self.store_replicas,
                "max_publish_gap_s": self.max_publish_gap_s,
                "max_keys_read_per_interval": self.max_keys_read_per_interval,
            },
            "averager": {
                "target_group_size": self.target_group_size,
                "matchmaking_time_s": self.matchmaking_s,
                "allreduce_timeout_s": self.allreduce_timeout_s,
                "request_timeout_s": self.rpc_s,
                "min_deadline_s": self.min_deadline,
                "max_deadline_s": max(120.0, 2 * self.min_deadline),
                "read_replicas": self.matchmaking_read_replicas,
                "store_replicas": self.matchmaking_store_replicas,
            },
            "step_timeout_s": self.step_timeout_s,
            "rpc_timeout_s": self.rpc_s,
            # a process joins while the others' peers keep the host busy
            "bootstrap_timeout_s": max(10.0, 2 * self.rpc_s),
            "shared_address": self.shared_address,
        }


class _Child:
    """One process of peers, driven over its stdin and stdout."""

    def __init__(self, index: int, ranks: list[int], process: asyncio.subprocess.Process):
        self.index = index
        self.ranks = ranks
        self.process = process

    @classmethod
    async def start(cls, index: int, ranks: list[int], spec: dict, log_level: str) -> _Child:
        # the repository first, then what this process was given
        paths = (str(_REPO_ROOT), os.environ.get("PYTHONPATH"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "peer.bench.swarm_child", log_level,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, limit=_LINE_LIMIT_BYTES,
        )  # fmt: skip
        child = cls(index, ranks, process)
        child.send(spec | {"ranks": ranks})
        return child

    def send(self, message: dict[str, Any]) -> None:
        if self.process.stdin is not None and not self.process.stdin.is_closing():
            self.process.stdin.write((json.dumps(message) + "\n").encode())

    async def receive(self) -> dict[str, Any]:
        line = await self.process.stdout.readline()
        if not line:
            code = await self.process.wait()
            raise RuntimeError(f"swarm process {self.index} exited with {code}")
        return json.loads(line)

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


async def _hello(child: _Child, timeout_s: float) -> list[str]:
    message = await asyncio.wait_for(child.receive(), timeout_s)
    if message.get("type") != "hello":
        raise RuntimeError(f"swarm process {child.index} did not start: {message}")
    return message["addresses"]


async def _start_children(config: SwarmBenchConfig) -> list[_Child]:
    """The processes, one after another: each joins through peers of those before it (one
    node that every peer bootstraps from at once answered none of them at 256 peers)."""
    ranks, per = list(range(config.num_peers)), config.peers_per_process
    chunks = [ranks[i : i + per] for i in range(0, len(ranks), per)]
    spec = config.child_spec()
    startup_s = 60.0 + 0.5 * config.num_peers
    chooser = random.Random(config.seed)
    children: list[_Child] = []
    addresses: list[str] = []
    try:
        for index, chunk in enumerate(chunks):
            initial = chooser.sample(addresses, min(_NUM_INITIAL_PEERS, len(addresses)))
            child = await _Child.start(
                index, chunk, spec | {"initial_peers": initial}, config.log_level
            )
            children.append(child)
            addresses += await _hello(child, startup_s)
    except BaseException:
        await asyncio.gather(*(child.stop() for child in children))
        raise
    return children


async def _collect(children: list[_Child], config: SwarmBenchConfig, deadline: float) -> dict:
    """Every child's lines until every peer is done (or ``seconds`` passed), then its facts."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(child: _Child) -> None:
        while True:
            try:
                message = await child.receive()
            except Exception as e:  # handed to the collector, which raises it
                await queue.put(e)
                return
            await queue.put(message)
            if message.get("type") == "process":
                return

    pumps = [asyncio.create_task(pump(child)) for child in children]
    collected: dict[str, Any] = {"round": [], "caught_up": [], "process": [], "error": []}
    collected["status"] = {}  # the last status line of each process
    done: set[int] = set()
    started = time.monotonic()
    end = deadline if config.seconds is None else min(deadline, started + config.seconds)
    stopped = False
    next_status_s = started + _STATUS_INTERVAL_S
    try:
        for child in children:
            child.send({"cmd": "go"})
        while len(collected["process"]) < len(children):
            if not stopped and (len(done) == config.num_peers or time.monotonic() >= end):
                stopped, collected["stop_s"] = True, time.monotonic() - started
                for child in children:
                    child.send({"cmd": "stop"})
                end = time.monotonic() + _STOP_TIMEOUT_S
            try:
                message = await asyncio.wait_for(queue.get(), max(0.01, end - time.monotonic()))
            except TimeoutError:
                if stopped:
                    raise RuntimeError("swarm processes did not answer stop") from None
                continue
            if isinstance(message, Exception):
                raise message
            kind = message.get("type")
            if kind == "status":
                collected["status"][message["index"]] = message
            elif kind == "done":
                done.add(message["rank"])
            elif kind in collected:
                collected[kind].append(message)
            if time.monotonic() >= next_status_s:  # a long run shows that it moves
                next_status_s = time.monotonic() + _STATUS_INTERVAL_S
                _print_status(collected, done, started)
        collected["timed_out"] = config.seconds is None and len(done) < config.num_peers
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    return collected


def _print_status(collected: dict[str, Any], done: set[int], started: float) -> None:
    rounds: dict[int, int] = {}
    for fact in collected["round"]:
        rounds[fact["epoch"]] = rounds.get(fact["epoch"], 0) + 1
    epochs: dict[int, int] = {}
    seen, fractions = [], []
    for status in collected["status"].values():
        for epoch, count in status["epochs"].items():
            epochs[int(epoch)] = epochs.get(int(epoch), 0) + count
        seen += status["peers_seen"]
        fractions += status["target_fraction"]
    median = statistics.median
    print(
        f"peer bench swarm: {time.monotonic() - started:.0f} s, peers per epoch "
        f"{dict(sorted(epochs.items()))}, rounds per epoch {dict(sorted(rounds.items()))}, "
        f"{len(done)} peers done; peers seen p50 {median(seen) if seen else None}, "
        f"target reached p50 {median(fractions) if fractions else None}",
        file=sys.stderr,
        flush=True,
    )


async def run_swarm_bench_async(config: SwarmBenchConfig) -> dict[str, Any]:
    """Run the swarm and return the summary (see :func:`peer.bench.swarm_summary.summarize`).

    Raises:
        RuntimeError: a process failed to start or exited early.
    """
    deadline = time.monotonic() + config.run_timeout_s()
    children = await _start_children(config)
    try:
        collected = await _collect(children, config, deadline)
        for child in children:
            await asyncio.wait_for(child.process.wait(), _STOP_TIMEOUT_S)
    finally:
        await asyncio.gather(*(child.stop() for child in children))
    resolved = {
        "batch_size": config.batch_size,
        "matchmaking_s": config.matchmaking_s,
        "rpc_s": config.rpc_s,
        "min_deadline": config.min_deadline,
    }
    return summarize(collected, dataclasses.asdict(config) | resolved)


def run_swarm_bench(config: SwarmBenchConfig) -> dict[str, Any]:
    """:func:`run_swarm_bench_async` from synchronous code."""
    return asyncio.run(run_swarm_bench_async(config))
