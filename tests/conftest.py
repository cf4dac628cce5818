"""Fixtures shared by every test package, and how the suite is spread over workers.

``make test`` runs the suite on several pytest-xdist workers (``--dist loadgroup``). Tests that
share a machine-wide resource run one after another on one worker: every test that makes
network namespaces (they list and clean up namespaces by a shared prefix, and a sweep's netns
launcher owns the host's ``vpx-`` names while it runs) is in the group ``netns``. The heaviest
tests that start many processes (several peers, a hivemind daemon each, a Ray cluster) are in
the group ``processes``, so that at most one of them competes with the netns group for the
cores: two of them at once on a 2-core machine would read as slow peers, not as a busy host.
Tests whose assertions read the host's timing through a system we do not control (hivemind's
own progress and matchmaking), to a few percent (the profiler against its injected delays), or
against real-time timeouts in one process (the DHT simulation) are marked ``serial``: ``make test``
runs them afterwards, alone on the host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from tests.socket_writes import transport_writes  # noqa: F401 (a fixture for every test)

# Test files that make network namespaces (see the module docstring).
NETNS_FILES = {
    "experiments/linkemu/test_linkemu.py",
    "experiments/linkemu/test_linkemu_shaper.py",
    "experiments/launch/test_nat.py",
    "experiments/launch/test_nat_relay.py",
    "experiments/launch/test_nat_swarm.py",
    "experiments/launch/test_nat_upnp.py",
    "experiments/launch/test_netns.py",
    "experiments/launch/test_netns_dashboard.py",
    "experiments/test_wan.py",
    "experiments/test_wan_bench.py",
    "experiments/test_wan_deadlines.py",
    "experiments/test_wan_rtt.py",
    "verdicts/test_verdicts.py",
}
# The heaviest tests that start many processes (see the module docstring).
PROCESS_HEAVY_FILES = {
    "adversarial/test_swarm_e2e.py",
    "api/test_examples.py",
    "experiments/test_local_sweep.py",
    "experiments/launch/test_ray.py",
    "peer/bench/test_bench_swarm.py",
    "peer/cli/test_cli.py",
    "peer/hivemind/test_hivemind_dashboard.py",
    "peer/run/test_kill_mid_round.py",
    "peer/run/test_newcomer_fast_epochs.py",
}
# Run after the others, alone on the host (see the module docstring).
SERIAL_FILES = {
    "dht/tools/test_simulation.py",  # 150 nodes on one loop against real 1 s RPC timeouts
    "peer/hivemind/test_hivemind_backend.py",
    "peer/profiling/test_profiler.py",
}
# Files with some tests marked ``serial`` in place (tests/test_suite_groups.py checks the list).
SERIAL_MARKED_FILES = {
    "adversarial/test_net_connection_shares.py",
    "adversarial/test_net_relay_shares.py",
    "adversarial/test_net_request_shares.py",
    "peer/bench/test_bench_method.py",
    "verdicts/test_verdicts.py",
}
_TESTS = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m serial`` (``make test``'s second part), import only the files that hold serial
    tests: importing the whole suite to deselect it took about 13 s of that part."""
    if config.getoption("markexpr", "") != "serial" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    try:
        path = collection_path.resolve().relative_to(_TESTS).as_posix()
    except ValueError:  # not one of this suite's files
        return None
    return path not in SERIAL_FILES | SERIAL_MARKED_FILES


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.relative_to(_TESTS).as_posix()
        if path in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
        elif path in NETNS_FILES:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif path in PROCESS_HEAVY_FILES:
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture
async def make_transport():
    """Start real HttpTransports on 127.0.0.1 (port 0); all are closed at teardown.

    Call as ``await make_transport(config=None, handlers=None, streams=None)``.
    """
    started: list[HttpTransport] = []

    async def factory(config: TransportConfig | None = None, *, rpc=None, streams=None):
        transport = HttpTransport(PeerIdentity.generate(), config or TransportConfig())
        for name, handler in (rpc or {}).items():
            transport.add_rpc_handler(name, handler)
        for name, handler in (streams or {}).items():
            transport.add_stream_handler(name, handler)
        await transport.start()
        started.append(transport)
        return transport

    yield factory
    for transport in started:
        await transport.close()
