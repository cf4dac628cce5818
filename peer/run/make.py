"""Build the peer of the configured backend; each backend is imported only when chosen."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from peer.run.backend import PeerRunner

if TYPE_CHECKING:
    from peer.run.config import PeerConfig


def make_peer_run(config: PeerConfig, *, stop_event: threading.Event | None = None) -> PeerRunner:
    """The peer of ``config.backend``.

    Raises:
        ConfigError: an option the backend cannot honour, or hivemind is not installed.
        TaskError: the task cannot be built.
    """
    if config.backend == "hivemind":
        from peer.hivemind.backend import HivemindPeerRun

        return HivemindPeerRun(config, stop_event=stop_event)
    from peer.run.runner import PeerRun

    return PeerRun(config, stop_event=stop_event)
