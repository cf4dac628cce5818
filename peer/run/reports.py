"""What a native peer reports about its run besides its progress: its last rounds on the DHT
(``{run}/rounds``, :mod:`peer.swarm.round_log`) and its counters on ``GET /metrics``
(:mod:`peer.profiling.prometheus`). The dashboard (``peer monitor``) reads the first, Prometheus
the second.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from dht.kademlia.node import DHTNode
from dht.runtime import EventLoopThread
from peer.profiling.prometheus import PeerMetrics, PrometheusExporter
from peer.swarm.round import EpochStats, round_entry
from peer.swarm.round_log import RoundLog, RoundLogConfig

logger = logging.getLogger(__name__)
# Seconds a round entry's training loss may be old. The loss is the mean of the last batches'
# losses (a stack of tensors, and a sync on a GPU): read at every round, that costs a lone peer
# with 90 ms epochs about 0.2% of its throughput, and entries are published every few seconds.
LOSS_REFRESH_S = 1.0


class RunReports:
    """The round record and the ``/metrics`` endpoint of one peer.

    Args:
        peer_id: the peer's id.
        run_id: the run (DHT key prefix, a label on ``/metrics``).
        target_batch_size: samples per swarm epoch (published, so that readers know it).
        publish_interval_s: how often the round record is checked for news, in seconds.
        metrics: the peer's numbers for a scrape (None while it starts); runs on the event loop,
            so it must be quick.
    """

    def __init__(
        self,
        *,
        peer_id: str,
        run_id: str,
        target_batch_size: int,
        publish_interval_s: float,
        metrics: Callable[[], PeerMetrics | None],
    ):
        self.run_id = run_id
        self.exporter = PrometheusExporter(metrics, peer_id=peer_id, run_id=run_id)
        self.round_config = RoundLogConfig(
            target_batch_size=target_batch_size,
            publish_interval_s=publish_interval_s,
            record_ttl_s=max(10 * publish_interval_s, 60.0),
        )
        self.round_log: RoundLog | None = None
        # rounds already logged: the training loop compares it with its count after each step
        self.num_rounds_logged = 0
        self._recent_loss: float | None = None
        self._loss_read_s = -math.inf

    def install(self, transport) -> None:
        """Serve ``/metrics`` on ``transport`` (before it starts serving)."""
        self.exporter.install(transport)

    def start(
        self,
        loop_thread: EventLoopThread,
        node: DHTNode,
        *,
        epoch: int,
        timeout_s: float,
        num_peers: Callable[[], float] = lambda: 1.0,
    ) -> None:
        """Start publishing the round record through ``node`` (``num_peers``: this peer's
        count of the swarm, read on the event loop; it picks the record's bucket)."""
        self.round_log = RoundLog(
            dht=node, prefix=self.run_id, config=self.round_config, num_peers=num_peers
        )
        self.round_log.set_epoch(epoch)
        loop_thread.run(self.round_log.__aenter__(), timeout_s=timeout_s)

    def set_epoch(self, epoch: int) -> None:
        if self.round_log is not None:
            self.round_log.set_epoch(epoch)

    def log_rounds(
        self, stats: EpochStats, *, epoch: int, loss: Callable[[], float | None]
    ) -> None:
        """Add the rounds ``stats`` counted since the last call (``loss``: the recent training
        loss, asked only when there is news, at most every ``LOSS_REFRESH_S``). Call at least
        every 100 rounds."""
        num_new = stats.num_rounds - self.num_rounds_logged
        if self.round_log is None or num_new <= 0:
            return
        self.num_rounds_logged = stats.num_rounds
        now = time.monotonic()
        if now - self._loss_read_s >= LOSS_REFRESH_S:
            self._recent_loss, self._loss_read_s = loss(), now
        recent_loss = self._recent_loss
        for result in stats.history[-num_new:]:
            self.round_log.add(round_entry(result, epoch=epoch - 1, loss=recent_loss))

    def close(self, loop_thread: EventLoopThread, *, timeout_s: float) -> None:
        """Stop publishing (before the DHT node closes); safe to call twice."""
        round_log, self.round_log = self.round_log, None
        if round_log is None:
            return
        try:
            loop_thread.run(round_log.close(), timeout_s=timeout_s)
        except Exception:  # auxiliary: its failure must not keep the peer from leaving
            logger.exception("the round record publisher failed")
