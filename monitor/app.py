"""The live dashboard: rich Live on a terminal, one plain line per interval otherwise.

:class:`LiveApp` is thread-agnostic: it asks ``read()`` for a future of the next view (a
coroutine submitted to whichever event loop owns the DHT node), so ``peer monitor`` runs it in the
main thread, ``peer join --dashboard`` in a thread beside the training loop, and ``peer demo``
beside its asyncio loop. Terminal manners: the alternate screen (the shell's scrollback stays
clean), at most :data:`monitor.config.MAX_REFRESH_PER_S` redraws a second, keys read in cbreak
mode (``q`` quits; Ctrl-C quits too; in a big swarm the arrows and pages scroll the whole peer
table, see :mod:`monitor.keys`), and the terminal restored on every way out. Log records are
held back while the screen is live (they would tear it) and the warnings are printed after.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live

from monitor.config import MonitorConfig
from monitor.crowd import is_crowd, page_rows
from monitor.keys import PeerScroll, parse_keys
from monitor.render import Dashboard, plain_line, render_dashboard
from monitor.state import SwarmView

logger = logging.getLogger(__name__)
ViewReader = Callable[[], "concurrent.futures.Future[SwarmView] | None"]
# Keys polled this often, in seconds (also the granularity of noticing a stop).
KEY_POLL_S = 0.1
# Without news the screen is redrawn this often, in seconds (the footer's clock).
FOOTER_TICK_S = 1.0
# How long closing a dashboard that runs in a thread waits for it to restore the terminal.
JOIN_TIMEOUT_S = 10.0
MAX_HELD_LOG_RECORDS = 200


class _Keyboard:
    """Single keys from a terminal's stdin in cbreak mode (restored on exit); no-op otherwise."""

    def __init__(self, stream=None):
        self._stream = stream if stream is not None else sys.stdin
        self._fd: int | None = None
        self._saved = None

    def __enter__(self) -> _Keyboard:
        try:
            import termios
            import tty

            fd = self._stream.fileno()
            if os.isatty(fd):
                self._saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)  # keys arrive one by one; Ctrl-C still sends SIGINT
                self._fd = fd
        except (ImportError, OSError, ValueError, AttributeError):
            self._fd = None  # no terminal to read keys from: q is not available
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None and self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._fd = None

    def read(self, timeout_s: float) -> str:
        """Keys typed within ``timeout_s`` ("" if none); just waits without a terminal."""
        if self._fd is None:
            time.sleep(timeout_s)
            return ""
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        return os.read(self._fd, 64).decode(errors="ignore") if ready else ""


class _HeldLogs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: collections.deque[logging.LogRecord] = collections.deque(
            maxlen=MAX_HELD_LOG_RECORDS
        )

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def hold_logs() -> Iterator[_HeldLogs]:
    """Route the root logger's stream output into memory while a full-screen view is live;
    afterwards the held warnings go to the handlers that were there."""
    root = logging.getLogger()
    streams = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    held = _HeldLogs()
    for handler in streams:
        root.removeHandler(handler)
    root.addHandler(held)
    try:
        yield held
    finally:
        root.removeHandler(held)
        for handler in streams:
            root.addHandler(handler)
        for record in held.records:
            for handler in streams:
                if record.levelno >= handler.level:
                    handler.handle(record)


class LiveApp:
    """Runs the dashboard until ``q``, Ctrl-C or ``stop_event``.

    Args:
        read: starts a read of the swarm and returns its future (None: nothing to read yet).
        config: intervals and refresh rate.
        console: where to draw (a terminal gets the live view, anything else plain lines).
        stop_event: set by the owner to end the app.
        on_quit: called when the user quits (``q`` or Ctrl-C in this app's thread).
        source: where the data comes from, for the footer (e.g. the bootstrap URL).
    """

    def __init__(
        self,
        read: ViewReader,
        *,
        config: MonitorConfig,
        console: Console | None = None,
        stop_event: threading.Event | None = None,
        on_quit: Callable[[], None] | None = None,
        source: str = "",
    ):
        self.read = read
        self.config = config
        self.console = console or Console()
        self.stop_event = stop_event or threading.Event()
        self.on_quit = on_quit
        self.source = source
        self.view: SwarmView | None = None
        self._pending: concurrent.futures.Future[SwarmView] | None = None
        self._next_read_s = 0.0
        self._read_at_s: float | None = None
        self._held: _HeldLogs | None = None
        self.num_frames = 0  # live redraws so far
        self.scroll = PeerScroll()  # the whole peer table of a big swarm (keys, this thread)

    # ---- reads -------------------------------------------------------------------------------

    def _poll(self) -> bool:
        """Start a read when due, collect a finished one; True when a new view arrived."""
        now = time.monotonic()
        if self._pending is None and now >= self._next_read_s:
            try:
                self._pending = self.read()
            except RuntimeError:  # the owner's event loop is gone: nothing more to read
                self._pending = None
            if self._pending is None:
                self._next_read_s = now + self.config.interval_s
        if self._pending is None or not self._pending.done():
            return False
        future, self._pending = self._pending, None
        self._next_read_s = now + self.config.interval_s
        try:
            self.view = future.result()
        except (concurrent.futures.CancelledError, RuntimeError):  # the owner is closing
            return False
        except Exception as e:  # a bad read must not take the screen (or the peer) down
            logger.warning("reading the swarm failed: %s", e or type(e).__name__)
            return False
        self._read_at_s = now
        return True

    def once(self, timeout_s: float) -> SwarmView:
        """One read, waited for (``--once``).

        Raises:
            TimeoutError: no view within ``timeout_s``.
        """
        future = self.read()
        if future is None:
            raise TimeoutError("nothing to read yet")
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no view within {timeout_s:g} s") from None

    def print_once(self, timeout_s: float) -> SwarmView:
        """Read once and print the whole dashboard (every row) to the console."""
        view = self.once(timeout_s)
        self.console.print(render_dashboard(view, width=self.console.width, footer=self.source))
        return view

    # ---- loops -------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until quit or stopped; restores the terminal on every way out."""
        try:
            if self.console.is_terminal:
                self._run_live()
            else:
                self._run_plain()
        except KeyboardInterrupt:
            self._quit()
        finally:
            if self._pending is not None:
                self._pending.cancel()

    def _quit(self) -> None:
        if self.on_quit is not None:
            self.on_quit()

    def _footer(self) -> str:
        parts = ["q quits"]
        if self._read_at_s is not None:
            parts.append(f"read {time.monotonic() - self._read_at_s:.1f}s ago")
        if self._held is not None and self._held.records:
            last = self._held.records[-1]
            parts.append(f"log: {last.levelname} {last.getMessage()}")
        elif self.source:
            parts.append(self.source)
        return " · ".join(parts)

    def _run_live(self) -> None:
        dashboard = Dashboard(lambda: self.view, self._footer, lambda: self.scroll.offset)
        min_gap_s = 1.0 / self.config.refresh_per_s
        with (
            hold_logs() as held,
            _Keyboard() as keyboard,
            Live(
                dashboard,
                console=self.console,
                screen=True,
                auto_refresh=False,  # redrawn when there is news, not on a timer
                redirect_stdout=False,
                redirect_stderr=False,
            ) as live,
        ):
            self._held = held
            drawn_s, drawn_size, dirty = -math.inf, None, True
            while not self.stop_event.is_set():
                dirty = self._poll() or dirty
                now, size = time.monotonic(), self.console.size
                # news, a resize, or the footer's "read Ns ago" ticking; never above the cap
                due = dirty or size != drawn_size or now - drawn_s >= FOOTER_TICK_S
                if due and now - drawn_s >= min_gap_s:
                    live.refresh()
                    self.num_frames += 1
                    drawn_s, drawn_size, dirty = now, size, False
                keys = parse_keys(keyboard.read(KEY_POLL_S))
                if "quit" in keys:
                    self._quit()
                    return
                for key in keys:
                    dirty = self.press(key) or dirty

    def press(self, key: str) -> bool:
        """Act on a key of the live view (by :func:`monitor.keys.parse_keys`' name); True when
        the screen changes. Scrolling applies to a big swarm only: a small one shows every
        peer already."""
        view, (width, height) = self.view, self.console.size
        if view is None or not is_crowd(view, width, height):
            return False
        rows = page_rows(view, width, height)
        return self.scroll.press(key, num_peers=view.num_peers, rows=rows)

    def _run_plain(self) -> None:
        while not self.stop_event.is_set():
            if self._poll() and self.view is not None:
                self.console.out(plain_line(self.view), highlight=False)  # never wrapped
            self.stop_event.wait(KEY_POLL_S)


@contextmanager
def running_in_thread(app: LiveApp) -> Iterator[LiveApp]:
    """Run ``app`` in a thread of its own for the block; the exit stops it and joins it."""
    thread = threading.Thread(target=app.run, name="vp-dashboard", daemon=True)
    thread.start()
    try:
        yield app
    finally:
        app.stop_event.set()
        thread.join(JOIN_TIMEOUT_S)
