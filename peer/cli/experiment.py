"""The monitor's live dashboard for ``peer experiment run`` (an :data:`experiments.watching.Watch`).

``experiments`` may not import ``monitor``; this composition-root module hands the dashboard in.
Each swarm configuration gets a client of its own that joins through the configuration's
bootstrap: a DHT client node of ours (inside the netns launcher's hub namespace when there is
one), or for ``backend = "hivemind"`` a client-mode hivemind.DHT read through
:mod:`peer.cli.hivemind`; the footer shows the sweep position. Imports are deferred to the
calls so that ``peer --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

# Seconds between two reads of the running configuration's records.
READ_INTERVAL_S = 1.0


def watch_configuration(
    target, on_quit: Callable[[], None], *, console=None
) -> AbstractContextManager[object]:
    """Show the swarm of ``target`` (a :class:`experiments.watching.WatchTarget`) on ``console``
    (stdout by default) while open; ``peer experiment run`` injects it when stdout is a terminal.
    Entering yields the :class:`monitor.app.LiveApp`.

    Raises (on entering):
        experiments.watching.WatchUnavailable: hivemind in network namespaces (no reader there).
        dht.errors.DHTError: the bootstrap did not answer from here.
    """
    from monitor.config import MonitorConfig

    config = MonitorConfig(
        run_id=target.run_id,
        interval_s=READ_INTERVAL_S,
        target_batch_size=target.target_batch_size,
    )
    source = f"{target.label} · via {target.bootstrap_url}"
    if target.backend == "hivemind":
        return _hivemind_dashboard(target, config, on_quit, source, console)
    from monitor.embed import client_dashboard

    return client_dashboard(
        [target.bootstrap_url],
        config=config,
        on_quit=on_quit,
        console=console,
        source=source,
        enter_network=target.enter_network,
    )


@contextmanager
def _hivemind_dashboard(
    target, config, on_quit: Callable[[], None], source: str, console
) -> Iterator[object]:
    from experiments.watching import WatchUnavailable

    if target.enter_network is not None:
        # hivemind's DHT and its p2pd are processes of their own, started outside the namespace
        raise WatchUnavailable(
            "a hivemind swarm in network namespaces is not readable from the host"
        )
    from monitor.records import records_dashboard
    from peer.cli.hivemind import open_monitor_records

    with open_monitor_records([target.bootstrap_url], target.run_id) as records:
        records.source = source
        with records_dashboard(records, config=config, on_quit=on_quit, console=console) as app:
            yield app
