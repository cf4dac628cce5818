"""The dashboard of a swarm on another backend (hivemind's), whose records come from a blocking
reader that the command line hands in: the monitor never imports another backend.

A :class:`RecordSource` returns the same parsed records as :class:`monitor.reader.SwarmReader`
reads from our DHT (:class:`peer.swarm.progress.PeerProgress`,
:class:`peer.records.profile.ProfileRecord`,
:class:`peer.swarm.round_log.RoundLogRecord`), so the views, alerts and panels are the same.
:class:`ThreadedSwarmReader` runs its reads in a worker thread of its own and hands
:class:`monitor.app.LiveApp` their futures; :func:`records_dashboard` shows it beside something
else (a training peer, the demo), as :mod:`monitor.embed` does for our DHT.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console

from dht.errors import DHTError
from monitor.app import LiveApp, running_in_thread
from monitor.config import MonitorConfig
from monitor.state import SwarmView, ViewBuilder

logger = logging.getLogger(__name__)


class RecordSource(Protocol):
    """A swarm's records, read with blocking calls (e.g. through hivemind's DHT).

    Attributes:
        source: where the records come from, for the dashboard's footer.
    """

    source: str

    def fetch(self, timeout_s: float) -> dict[str, list]:
        """``progress``, ``profiles`` and ``rounds``: the parsed records that
        :meth:`monitor.state.ViewBuilder.build` takes, read within ``timeout_s``.

        Raises:
            TimeoutError: no full answer in time.
            dht.errors.DHTError: the read failed.
        """
        ...

    def now(self) -> float:
        """The time (unix seconds) of the records' clock."""
        ...


class ThreadedSwarmReader:
    """Builds successive views from a :class:`RecordSource` in one worker thread of its own
    (one read at a time: the views remember the previous one). ``close`` is safe twice.

    Args:
        records: the reader of the swarm.
        config: the monitor's settings.
        local_peer_id: the peer the dashboard runs in, if any (its own panels).
    """

    def __init__(
        self, records: RecordSource, config: MonitorConfig, *, local_peer_id: str | None = None
    ):
        self.records = records
        self.config = config
        self.builder = ViewBuilder(config, local_peer_id=local_peer_id)
        self._records: dict[str, list] = {
            "progress": [],
            "profiles": [],
            "rounds": [],
            "states": [],
        }
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vp-monitor-read"
        )

    def read(self) -> SwarmView:
        """The swarm now (blocking); on a failed read, the last records with ``error`` set."""
        error = None
        try:
            self._records = self.records.fetch(self.config.read_timeout_s)
        except TimeoutError as e:
            error = str(e) or f"no answer within {self.config.read_timeout_s:g} s"
        except DHTError as e:
            error = str(e) or type(e).__name__
        if error is not None:
            logger.debug("swarm read failed: %s", error)
        return self.builder.build(**self._records, now=self.records.now(), error=error)

    def submit(self) -> concurrent.futures.Future[SwarmView]:
        """Start a read in the worker thread (the ``read`` of :class:`LiveApp`).

        Raises:
            RuntimeError: the reader is closed.
        """
        return self._executor.submit(self.read)

    def close(self) -> None:
        """Drop reads not started; wait for the one in flight (bounded by its timeout)."""
        self._executor.shutdown(wait=True, cancel_futures=True)


@contextmanager
def records_dashboard(
    records: RecordSource,
    *,
    config: MonitorConfig,
    on_quit: Callable[[], None],
    local_peer_id: str | None = None,
    console: Console | None = None,
) -> Iterator[LiveApp]:
    """Show the swarm that ``records`` reads, in a thread beside the caller's work, until the
    block ends; the exit stops the app, joins its thread and leaves the terminal as it was.

    Args:
        records: the reader of the swarm (its ``source`` goes to the footer).
        config: the monitor's settings (run id, intervals).
        on_quit: called when the user presses q.
        local_peer_id: the peer the dashboard runs in, if any (its own panels).
        console: where to draw (stdout by default).
    """
    reader = ThreadedSwarmReader(records, config, local_peer_id=local_peer_id)
    app = LiveApp(
        reader.submit, config=config, console=console, on_quit=on_quit, source=records.source
    )
    try:
        with running_in_thread(app):
            yield app
    finally:
        reader.close()
