"""The monitor's live dashboard for ``peer experiment run`` (an :data:`experiments.watching.Watch`).

``experiments`` may not import ``monitor``; this composition-root module hands the dashboard in.
Each swarm configuration gets a DHT client node of its own that joins through the
configuration's bootstrap (inside the netns launcher's hub namespace when there is one) and the
monitor's live view; the footer shows the sweep position. Imports are deferred to the calls so
that ``peer --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

# Seconds between two reads of the running configuration's records.
READ_INTERVAL_S = 1.0


def watch_configuration(target, on_quit: Callable[[], None]) -> AbstractContextManager[object]:
    """Show the swarm of ``target`` (a :class:`experiments.watching.WatchTarget`) while open;
    ``peer experiment run`` injects it when stdout is a terminal.

    Raises:
        experiments.watching.WatchUnavailable: a hivemind configuration (its records live in
            hivemind's DHT, which the monitor does not read).
    """
    from experiments.watching import WatchUnavailable
    from monitor.config import MonitorConfig
    from monitor.embed import client_dashboard

    if target.backend != "native":
        raise WatchUnavailable(
            f"the {target.backend} backend's records are not in the native DHT that the monitor "
            "reads (the progress bar shows the loss)"
        )
    config = MonitorConfig(
        run_id=target.run_id,
        interval_s=READ_INTERVAL_S,
        target_batch_size=target.target_batch_size,
    )
    return client_dashboard(
        [target.bootstrap_url],
        config=config,
        on_quit=on_quit,
        source=f"{target.label} · via {target.bootstrap_url}",
        enter_network=target.enter_network,
    )
