"""Peers of a benchmark on an emulated network: ``peer bench allreduce`` with ``--latency-ms``,
``--bandwidth-mbit`` or ``--loss-pct``.

:func:`emulated_places` builds the netns launcher's network for N peers (a namespace each, a
shaped link each to the hub's bridge; ``tc`` where the kernel has ``sch_netem``, else the
user-space link emulator) and yields, per peer, a function that moves a process into its
namespace and the address it listens on. Between two peers a packet crosses two links, so each
link gets half the one-way latency asked for, and a loss rate such that a packet crossing both
is lost with the probability asked for; the rate applies to each peer's link.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from experiments.launch.netns import NetnsLauncher, address_of, enter_namespace
from experiments.spec import NetworkSpec


@contextmanager
def emulated_places(
    num_peers: int,
    *,
    latency_ms: float | None,
    bandwidth_mbit: float | None,
    loss_percent: float | None = None,
    tcp_congestion: str | None = None,
) -> Iterator[list[tuple[Callable[[], None], str]]]:
    """One (enter, address) per peer, on a network where two peers are ``latency_ms`` apart one
    way, a packet between them is lost with probability ``loss_percent`` / 100, and each peer's
    link carries ``bandwidth_mbit``; TCP in the peers' namespaces uses ``tcp_congestion`` (None:
    the host's default). Everything is removed on exit.

    Raises:
        experiments.launch.base.LaunchError: not root, a tool is missing, or the set-up failed.
    """
    per_link_loss = 1.0 - math.sqrt(1.0 - (loss_percent or 0.0) / 100)  # two links in a row
    network = NetworkSpec(
        latency_ms=(latency_ms or 0.0) / 2,
        bandwidth_mbit=bandwidth_mbit,
        loss_percent=100 * per_link_loss,
        tcp_congestion=tcp_congestion,
    )
    with NetnsLauncher(network) as launcher, tempfile.TemporaryDirectory() as tmp:
        launcher.check()
        with launcher.open_session(Path(tmp), num_peers) as session:
            yield [
                (functools.partial(enter_namespace, name), address_of(index))
                for index, name in enumerate(session.namespaces)
            ]
