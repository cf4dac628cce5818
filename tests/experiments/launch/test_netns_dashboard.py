"""The sweep's dashboard under the netns launcher: the host has no route into the emulated
network, so the dashboard's own thread enters the hub namespace and reaches the bootstrap
there, while the sweep's thread stays on the host. Needs root and iproute2 (CI runs as root)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from rich.console import Console

from dht.errors import DHTError
from experiments.launch.base import ProcessPlan
from experiments.launch.netns import NetnsSession, delete_namespace, list_namespaces
from experiments.spec import NetworkSpec
from monitor.config import MonitorConfig
from monitor.embed import client_dashboard
from tests.experiments.launch.test_netns import REASON

pytestmark = [pytest.mark.timeout(120)]
if REASON is not None:
    pytestmark.append(pytest.mark.skip(reason=REASON))


def _own_namespace() -> str:
    return os.readlink("/proc/thread-self/ns/net")


def test_the_dashboard_reaches_the_bootstrap_through_the_hub_namespace(tmp_path: Path):
    prefix = f"vpx-d{os.getpid()}"
    config = MonitorConfig(run_id="netns-dash", interval_s=0.2)
    host_namespace = _own_namespace()
    try:
        with NetnsSession(tmp_path, prefix, 1, NetworkSpec()) as session:
            plan = ProcessPlan(name="dht", args=["-m", "peer", "dht"], metrics=False)
            url = session.start_bootstrap(plan)
            assert url.startswith("http://10.213.0.1:"), url
            output = io.StringIO()
            console = Console(file=output, width=100)
            with pytest.raises(DHTError):  # from the host's network: no route there
                with client_dashboard(
                    [url], config=config, on_quit=lambda: None, console=console,
                    connect_timeout_s=1.0,
                ):  # fmt: skip
                    pass
            with client_dashboard(
                [url], config=config, on_quit=lambda: None, console=console,
                enter_network=session.network_entry(),
            ) as app:  # fmt: skip
                deadline = time.monotonic() + 30
                while app.view is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert app.view is not None and app.view.error is None, app.view
                assert _own_namespace() == host_namespace  # only the dashboard's thread moved
            assert "run=netns-dash" in output.getvalue()
        assert list_namespaces(prefix) == []
    finally:
        for name in list_namespaces(prefix):
            delete_namespace(name)
