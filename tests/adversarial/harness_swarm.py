"""A malicious-peer harness: a real swarm of ``peer join`` processes on loopback, and an attacker
that speaks to it through the real code (its own DHT node, state server or averager).

:class:`Swarm` starts a bootstrap node (``peer dht``) and honest ``peer join`` processes (the
synthetic task, small and fast, each with a metrics stream), adds newcomers, stops everyone with
SIGTERM and collects what each printed. :class:`Attacker` is an in-process DHT node with a fresh
Ed25519 key of its own (it holds no swarm key: there is none here, as for a public swarm) that
joins through the bootstrap node and stores whatever it likes under the run's keys, with
properly signed records, as a stranger on the internet could.

:meth:`Swarm.check_healthy` is what every adversarial test asserts at the end: every honest peer
exited 0 by its own stop condition with no traceback, kept training (its epoch moved on while
the attack ran), its losses stayed finite, and the honest replicas are equal (the digests they
announce for their latest common epoch, read from the DHT, are the same).
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dht.config import DHTConfig, get_dht_time
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.kademlia.validation import owner_subkey
from dht.net.config import TransportConfig
from peer.records.buckets import read_every_record
from peer.records.progress import bucket_key, bucket_of
from peer.records.progress_read import ProgressSweep
from peer.records.state import STATE_RECORDS_PER_BUCKET, StateAnnouncement, parse_state, state_key

RUN_ID = "run"
SMALL_SWARM_LEVELS = (0, 1)  # the progress layouts of a swarm of up to about 45 peers
TASK_OPTIONS = ("hidden_dim=64", "num_eval_batches=0")
STOP_TIMEOUT_S = 60.0


@dataclass
class PeerProcess:
    """One honest ``peer join`` process, its metrics stream and its log (a file: a peer that
    logs at INFO would fill a pipe nobody reads until it stops, and block on it)."""

    name: str
    process: subprocess.Popen
    metrics: Path
    log: Path
    stdout: str = ""

    @property
    def stderr(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def lines(self) -> list[dict]:
        """The metrics stream so far (a line being written is skipped)."""
        if not self.metrics.exists():
            return []
        return [json.loads(x) for x in self.metrics.read_text().splitlines() if x.endswith("}")]

    @property
    def peer_id(self) -> str | None:
        lines = self.lines()
        return lines[0]["peer"] if lines else None

    def epoch(self) -> int:
        return max((line["epoch"] for line in self.lines()), default=-1)

    def summary(self) -> dict[str, Any]:
        return json.loads(self.stdout.strip().splitlines()[-1])


@dataclass
class Swarm:
    """A bootstrap node and honest peers; see the module docstring.

    Args:
        directory: where metrics streams go.
        peer_args: ``peer join`` options for every honest peer (beyond the harness's own).
    """

    directory: Path
    peer_args: tuple[str, ...] = ()
    bootstrap: subprocess.Popen | None = None
    url: str = ""
    peers: list[PeerProcess] = field(default_factory=list)

    def __enter__(self) -> Swarm:
        self.bootstrap = subprocess.Popen(
            [sys.executable, "-m", "peer", "--log-level", "WARNING", "dht", "--host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self.bootstrap.stdout.readline().strip()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for peer in self.peers:
            if peer.process.poll() is None:
                peer.process.kill()
            peer.process.wait(timeout=30)
        if self.bootstrap is not None and self.bootstrap.poll() is None:
            self.bootstrap.kill()
            self.bootstrap.wait(timeout=30)

    def add_peer(
        self, *extra: str, seed: int | None = None, log_level: str = "WARNING"
    ) -> PeerProcess:
        """Start one honest ``peer join`` (it stops at its own ``--max-time`` or on SIGTERM);
        its log at ``log_level`` goes to ``peer{index}.log`` (its ``stderr``)."""
        index = len(self.peers)
        metrics = self.directory / f"peer{index}.jsonl"
        log = self.directory / f"peer{index}.log"
        options = [f"--task-option={option}" for option in TASK_OPTIONS]
        command = [
            sys.executable, "-m", "peer", "--log-level", log_level, "join",
            "--host", "127.0.0.1", "--port", "0",
            "--initial-peers", self.url,
            "--run-id", RUN_ID,
            *options,
            "--torch-threads", "1",
            "--seed", str(index + 1 if seed is None else seed),
            "--metrics-file", str(metrics),
            "--metrics-interval", "0.5",
            "--json",
            *self.peer_args,
            *extra,
        ]  # fmt: skip
        with log.open("w") as log_file:  # the child holds its own descriptor
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True)
        peer = PeerProcess(f"peer{index}", process, metrics, log)
        self.peers.append(peer)
        return peer

    async def wait_until(self, condition, what: str, timeout_s: float = 90.0) -> None:
        """Poll ``condition()`` until true; fails with ``what`` (and the peers' stderr)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not condition():
            for peer in self.peers:
                if peer.process.poll() is not None and not peer.stdout:
                    peer.stdout = peer.process.communicate()[0]
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what}; stderr: {[p.stderr[-1500:] for p in self.peers]}")
            await asyncio.sleep(0.2)

    def stop(self, peers: list[PeerProcess] | None = None) -> None:
        """SIGTERM (a clean leave), then collect each one's output."""
        peers = self.peers if peers is None else peers
        for peer in peers:
            if peer.process.poll() is None:
                peer.process.send_signal(signal.SIGTERM)
        for peer in peers:
            peer.stdout += peer.process.communicate(timeout=STOP_TIMEOUT_S)[0]

    def check_healthy(self, *, epoch_before_attack: int, min_epochs_after: int = 2) -> None:
        """The assertions of the module docstring, for every honest peer (stopped first)."""
        for peer in self.peers:
            assert peer.process.returncode == 0, (peer.name, peer.stderr[-3000:])
            assert "Traceback" not in peer.stderr, (peer.name, peer.stderr[-3000:])
            summary = peer.summary()
            assert summary["stopped_by"] in ("max_time", "stop_event"), summary
            assert summary["epoch"] >= epoch_before_attack + min_epochs_after, (
                peer.name,
                summary,
                epoch_before_attack,
            )
            losses = [line["loss"] for line in peer.lines() if line.get("loss") is not None]
            assert losses and all(math.isfinite(loss) for loss in losses), peer.name
            assert summary["final_loss"] is not None and math.isfinite(summary["final_loss"])


def equal_replicas(
    announcements: list[StateAnnouncement], peer_ids: list[str], *, newest: bool = True
) -> int:
    """The newest (or, with ``newest=False``, the oldest) epoch for which every peer of
    ``peer_ids`` announced a digest, asserting that they announced the same one for it."""
    by_peer = {a.peer_id: {d.epoch: d.digest for d in a.digests} for a in announcements}
    missing = [p[:8] for p in peer_ids if p not in by_peer]
    assert not missing, f"no state announcement from {missing}"
    common = set.intersection(*(set(by_peer[p]) for p in peer_ids))
    assert common, {p[:8]: sorted(by_peer[p]) for p in peer_ids}
    epoch = max(common) if newest else min(common)
    digests = {p[:8]: by_peer[p][epoch] for p in peer_ids}
    assert len(set(digests.values())) == 1, (epoch, digests)
    return epoch


async def wait_equal_replicas(
    attacker: Attacker, peer_ids: list[str], timeout_s: float = 20.0, *, newest: bool = True
) -> int:
    """:func:`equal_replicas` once every peer has announced a digest for a common epoch (their
    histories overlap within a few seconds of running side by side)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        announcements = await attacker.announcements()
        try:
            return equal_replicas(announcements, peer_ids, newest=newest)
        except AssertionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.3)


class Attacker:
    """A stranger: a fresh key and a DHT node of its own, joined through ``url``.

    Use as ``async with Attacker(url) as attacker``; :meth:`another_key` gives it more nodes
    (Sybils), each with its own key.
    """

    def __init__(self, url: str):
        self.url = url
        self._stack = AsyncExitStack()
        self._sweep = ProgressSweep(RUN_ID, max_samples_per_s=1e9)
        self.node: DHTNode | None = None
        self.nodes: list[DHTNode] = []

    async def __aenter__(self) -> Attacker:
        self.node = await self.another_key()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    async def another_key(self, *, client_mode: bool = True, before_start=None) -> DHTNode:
        """One more node with a fresh key (client mode: no server, like a peer behind NAT);
        ``before_start(transport, node)`` adds handlers (a state server) before it serves."""
        identity = PeerIdentity.generate()
        transport = HttpTransport(identity, TransportConfig(client_mode=client_mode))
        node = DHTNode(
            transport=transport, identity=identity, config=DHTConfig(initial_peers=[self.url])
        )
        if before_start is not None:
            before_start(transport, node)
        await self._stack.enter_async_context(transport)
        await self._stack.enter_async_context(node)
        self.nodes.append(node)
        return node

    async def store(self, key: str, value: Any, *, node: DHTNode | None = None) -> bool:
        """Store ``value`` under ``key`` in the attacker's own (signed) subkey; each store
        expires later than the last, so it replaces it."""
        node = node or self.node
        await asyncio.sleep(0.002)  # a later expiration than the previous store's
        return await node.store(key, value, get_dht_time() + 60, subkey=owner_subkey(node.peer_id))

    async def store_progress(self, value: Any, *, node: DHTNode | None = None) -> bool:
        """Store a progress record in ``node``'s own bucket at every level a small swarm's
        peers read (0 and 1: up to about 45 peers), as an honest peer would."""
        node = node or self.node
        stored = True
        for level in SMALL_SWARM_LEVELS:
            key = bucket_key(RUN_ID, level, bucket_of(node.peer_id, level))
            stored = await self.store(key, value, node=node) and stored
        return stored

    async def progress(self) -> list:
        """The honest peers' progress records as the attacker reads them (every bucket)."""
        records = await self._sweep.read(self.node)
        return [r for r in records if r.peer_id not in self.peer_ids]

    async def announcements(self) -> list[StateAnnouncement]:
        """Every state announcement in the DHT (the honest peers' digests among them)."""
        return await read_every_record(
            self.node,
            state_key(RUN_ID),
            num_peers=len(self.peer_ids) + 1,
            records_per_bucket=STATE_RECORDS_PER_BUCKET,
            parse=parse_state,
            newest_by=lambda announcement: announcement.epoch,
        )

    @property
    def peer_ids(self) -> set[str]:
        return {node.peer_id for node in self.nodes}
