"""``/metrics``' text, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peer.profiling.prometheus import PeerMetrics, PrometheusExporter

pytestmark = pytest.mark.timeout(30)


def parse(body: bytes) -> dict[str, float | dict]:
    values: dict = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if "phase" in sample.labels or "wait" in sample.labels:
                label = sample.labels.get("phase") or sample.labels["wait"]
                values.setdefault(sample.name, {})[label] = sample.value
            elif sample.labels:
                values[sample.name] = dict(sample.labels)
            else:
                values[sample.name] = sample.value
    return values


def test_a_scrape_reports_the_snapshot_of_that_moment():
    snapshots = [None]
    exporter = PrometheusExporter(lambda: snapshots[-1], peer_id="ab" * 32, run_id="r")
    content_type, body = exporter.render()
    assert content_type.startswith("text/plain")
    info = {"peer_id": "ab" * 32, "run_id": "r", "backend": "native"}
    assert parse(body) == {"vp_peer_info": info}  # nothing else while the peer starts
    snapshots.append(
        PeerMetrics(
            epoch=12,
            num_steps=340,
            num_samples=340 * 32,
            samples_per_s=812.5,
            phase_s={"forward": 3.25, "allreduce": 0.5},
            sent_bytes=10_000,
            recv_bytes=9_000,
            num_rounds=12,
            num_failed_rounds=1,
            num_swarm_peers=3,
            loss=0.75,
            deadlines_s={"matchmaking_s": 1.0, "sender_s": 1.25, "reducer_s": 2.5},
        )
    )
    values = parse(exporter.render()[1])
    assert values["vp_epoch"] == 12 and values["vp_samples_per_second"] == 812.5
    assert values["vp_steps_total"] == 340 and values["vp_samples_total"] == 10_880
    assert values["vp_phase_seconds_total"] == {"forward": 3.25, "allreduce": 0.5}
    assert values["vp_sent_bytes_total"] == 10_000 and values["vp_received_bytes_total"] == 9_000
    assert values["vp_rounds_total"] == 12 and values["vp_failed_rounds_total"] == 1
    assert values["vp_swarm_peers"] == 3 and values["vp_loss"] == 0.75
    waits = {"matchmaking": 1.0, "sender": 1.25, "reducer": 2.5}
    assert values["vp_deadline_seconds"] == waits
