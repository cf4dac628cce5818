"""The dashboard of a hivemind swarm, wired (part of the composition root, as :mod:`peer.cli.main`).

The monitor reads our DHT itself; a hivemind swarm it reads through
:class:`peer.hivemind.swarm.HivemindSwarmRecords` (a ``monitor.records.RecordSource``), handed
in from here: ``peer monitor --backend hivemind``, ``peer join --backend hivemind --dashboard``
and ``peer demo --backend hivemind``. hivemind and the monitor are imported only when one of
them runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager


@contextmanager
def open_monitor_records(initial_peers: list[str], run_id: str):
    """``peer monitor --backend hivemind``: a client-mode hivemind.DHT reading ``run_id``."""
    from peer.hivemind.swarm import open_swarm_records

    with open_swarm_records(initial_peers, run_id) as records:
        yield records


def join_companion(monitor_config, stop: threading.Event) -> Callable[..., AbstractContextManager]:
    """``peer join --backend hivemind --dashboard``: the swarm through the peer's own
    hivemind.DHT, this peer highlighted (q stops training; the peer then leaves as on Ctrl-C)."""

    def companion(run) -> AbstractContextManager:
        from monitor.records import records_dashboard
        from peer.hivemind.swarm import HivemindSwarmRecords

        records = HivemindSwarmRecords(
            run.dht, monitor_config.run_id, source=f"this peer: {run.address or 'client mode'}"
        )
        return records_dashboard(
            records, config=monitor_config, on_quit=stop.set, local_peer_id=run.swarm_peer_id
        )

    return companion


def demo_dashboard(monitor_config):
    """``peer demo --backend hivemind``: the swarm through the demo's bootstrap node (see
    :data:`peer.cli.demo.DashboardFactory`; the loop is not needed: hivemind's DHT is blocking)."""

    def factory(bootstrap, loop, console, on_quit) -> AbstractContextManager:
        from monitor.records import records_dashboard
        from peer.hivemind.swarm import HivemindSwarmRecords

        records = HivemindSwarmRecords(
            bootstrap.dht, monitor_config.run_id, source=f"via {bootstrap.address}"
        )
        return records_dashboard(records, config=monitor_config, on_quit=on_quit, console=console)

    return factory
