"""The sweep's dashboard of a ``backend = "hivemind"`` configuration: the peer CLI's factory reads
the swarm through its hivemind bootstrap (a client-mode hivemind.DHT). Needs the [hivemind]
extra."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
from rich.console import Console

pytest.importorskip("hivemind", reason="the hivemind backend needs the [hivemind] extra")

from experiments.watching import WatchTarget
from peer.cli.experiment import watch_configuration
from tests.experiments.helpers import ROOT

pytestmark = pytest.mark.timeout(120)


def test_a_hivemind_configuration_is_watched_through_its_bootstrap():
    bootstrap = subprocess.Popen(
        [sys.executable, "-m", "experiments.hivemind_dht"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        address = bootstrap.stdout.readline().strip()
        assert address.startswith("/ip4/127.0.0.1/tcp/"), address
        target = WatchTarget(
            run_id="hm-watch", bootstrap_url=address, config_name="c", position=2,
            num_configs=3, num_peers=2, target_batch_size=256, backend="hivemind",
            launcher="local",
        )  # fmt: skip
        output = io.StringIO()
        with watch_configuration(target, lambda: None, console=Console(file=output)) as app:
            assert app.source == f"config 2/3: c · via {address}"
            deadline = time.monotonic() + 60
            while app.view is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert app.view is not None and app.view.error is None, app.view
        assert "run=hm-watch" in output.getvalue()  # plain lines: not a terminal
    finally:
        bootstrap.terminate()
        bootstrap.wait(timeout=30)
