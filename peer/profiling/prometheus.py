"""``GET /metrics`` on the peer's HTTP port: its counters in the Prometheus text format.

Each peer has its own :class:`prometheus_client.CollectorRegistry` (never the process-global one:
tests and benchmarks run many peers in one process). Nothing is updated on the training path:
a custom collector asks the peer for a :class:`PeerMetrics` snapshot when a scraper comes, so a
scrape costs a few attribute reads and the phase clock's lock. This module is torch-free.

Exported (counters end in ``_total``):

* ``vp_peer_info{peer_id, run_id, backend}``: always 1; names the peer.
* ``vp_epoch``, ``vp_samples_per_second``, ``vp_swarm_peers``, ``vp_loss``: gauges.
* ``vp_steps_total``, ``vp_samples_total``: local steps and samples trained.
* ``vp_phase_seconds_total{phase}``: seconds charged to each phase of :mod:`peer.profiling.phases`.
* ``vp_sent_bytes_total``, ``vp_received_bytes_total``: the transport's payload bytes.
* ``vp_rounds_total``, ``vp_failed_rounds_total``: averaging rounds finished, and failed.
* ``vp_deadline_seconds{wait}``: the averager's current waits (``matchmaking``, ``sender``,
  ``reducer``, ``group_wait``, ``request``, ``allreduce``; measured or configured, see
  :mod:`averaging.allreduce.deadlines`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

logger = logging.getLogger(__name__)
METRICS_PATH = "/metrics"


@dataclass(frozen=True, kw_only=True)
class PeerMetrics:
    """What a peer reports to a scrape.

    Attributes:
        epoch: the peer's swarm epoch.
        num_steps: local steps trained.
        num_samples: local samples trained.
        samples_per_s: the peer's recent training rate.
        phase_s: phase -> seconds charged to it since the peer started.
        sent_bytes, recv_bytes: payload bytes the transport sent and received.
        num_rounds, num_failed_rounds: averaging rounds finished, and those that failed.
        num_swarm_peers: peers in the swarm by the peer's last estimate (itself included).
        loss: the last reported training loss, or None.
        deadlines_s: the averager's current waits in seconds, by name (``sender_s``, ...).
    """

    epoch: int
    num_steps: int
    num_samples: int
    samples_per_s: float
    phase_s: Mapping[str, float] = field(default_factory=dict)
    sent_bytes: int = 0
    recv_bytes: int = 0
    num_rounds: int = 0
    num_failed_rounds: int = 0
    num_swarm_peers: int = 1
    loss: float | None = None
    deadlines_s: Mapping[str, float] = field(default_factory=dict)


class _PeerCollector:
    """Turns one :class:`PeerMetrics` snapshot into metric families at each scrape."""

    def __init__(self, source: Callable[[], PeerMetrics | None], labels: dict[str, str]):
        self._source = source
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("vp_peer", "the peer this endpoint belongs to")
        info.add_metric([], self._labels)
        yield info
        metrics = self._source()
        if metrics is None:  # the peer is still starting
            return
        yield GaugeMetricFamily("vp_epoch", "the peer's swarm epoch", value=metrics.epoch)
        yield GaugeMetricFamily(
            "vp_samples_per_second",
            "local training samples per second, recently",
            value=metrics.samples_per_s,
        )
        yield GaugeMetricFamily(
            "vp_swarm_peers",
            "peers in the swarm by this peer's estimate (itself included)",
            value=metrics.num_swarm_peers,
        )
        if metrics.loss is not None:
            yield GaugeMetricFamily("vp_loss", "the last training loss", value=metrics.loss)
        counters = (
            ("vp_steps", "local training steps", metrics.num_steps),
            ("vp_samples", "local training samples", metrics.num_samples),
            ("vp_sent_bytes", "payload bytes sent by the transport", metrics.sent_bytes),
            ("vp_received_bytes", "payload bytes received by the transport", metrics.recv_bytes),
            ("vp_rounds", "averaging rounds finished (any outcome)", metrics.num_rounds),
            ("vp_failed_rounds", "averaging rounds that failed", metrics.num_failed_rounds),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        phases = CounterMetricFamily(
            "vp_phase_seconds", "seconds charged to each phase", labels=["phase"]
        )
        for phase, seconds in metrics.phase_s.items():
            phases.add_metric([phase], seconds)
        yield phases
        deadlines = GaugeMetricFamily(
            "vp_deadline_seconds", "the averager's current waits", labels=["wait"]
        )
        for name, seconds in metrics.deadlines_s.items():
            deadlines.add_metric([name.removesuffix("_s")], seconds)
        yield deadlines


class PrometheusExporter:
    """A peer's Prometheus registry and its ``/metrics`` handler.

    Args:
        source: returns the peer's numbers now, or None while it is starting; called on the
            event loop at each scrape, so it must be quick and must not block.
        peer_id: the peer's id (a label of ``vp_peer_info``).
        run_id: the run's name (a label too).
        backend: ``native`` or ``hivemind``.
    """

    def __init__(
        self,
        source: Callable[[], PeerMetrics | None],
        *,
        peer_id: str,
        run_id: str,
        backend: str = "native",
    ):
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"peer_id": peer_id, "run_id": run_id, "backend": backend}
        self.registry.register(_PeerCollector(source, labels))

    def render(self) -> tuple[str, bytes]:
        """The answer to ``GET /metrics``: (content type, body in the text format)."""
        return CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def install(self, transport) -> None:
        """Serve ``GET /metrics`` on ``transport`` (a :class:`dht.http.HttpTransport` that has
        not started yet)."""
        transport.add_http_get(METRICS_PATH, self.render)
