"""The live app's terminal manners: plain lines without a TTY, the alternate screen restored on
the way out, log records held back while the screen is live, a bounded refresh rate."""

from __future__ import annotations

import concurrent.futures
import io
import logging
import threading
import time

import pytest
from rich.console import Console

from dht.errors import ConfigError
from monitor.app import LiveApp
from monitor.config import MonitorConfig
from tests.monitor import sample
from tests.monitor.test_render import expected_samples

pytestmark = pytest.mark.timeout(60)
ENTER_ALT_SCREEN, LEAVE_ALT_SCREEN = "\x1b[?1049h", "\x1b[?1049l"


class CountingReader:
    """A read that answers at once with the sample swarm, counting calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> concurrent.futures.Future:
        self.calls += 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(sample.sample_view())
        return future


def run_for(app: LiveApp, seconds: float) -> None:
    thread = threading.Thread(target=app.run)
    thread.start()
    time.sleep(seconds)
    app.stop_event.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_without_a_terminal_it_prints_one_plain_line_per_interval():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=300)
    reader = CountingReader()
    app = LiveApp(reader, config=MonitorConfig(run_id="demo", interval_s=0.2), console=console)
    run_for(app, 1.5)
    lines = out.getvalue().splitlines()
    # about one line per 0.2 s interval: never a redraw storm, never silence
    assert 3 <= len(lines) <= 9, lines
    assert len(lines) == reader.calls or len(lines) == reader.calls - 1
    for line in lines:
        assert "\x1b" not in line
        assert "run=demo epoch=7" in line and "peers=4 clients=1" in line
        assert (
            f"samples={expected_samples()}/{sample.TARGET}" in line and "rounds=7 failed=1" in line
        )
        assert "bottleneck=compute" in line


def test_on_a_terminal_it_draws_on_the_alternate_screen_and_restores_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, height=24, color_system=None)
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    root = logging.getLogger()
    root.addHandler(handler)
    app = LiveApp(
        CountingReader(), config=MonitorConfig(run_id="demo", interval_s=0.2), console=console
    )
    try:
        thread = threading.Thread(target=app.run)
        started = time.monotonic()
        thread.start()
        time.sleep(0.5)
        logging.getLogger("monitor.test").warning("a warning while the screen is live")
        time.sleep(0.5)
        assert logs.getvalue() == ""  # held back: it would tear the screen
        app.stop_event.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert handler in root.handlers  # given back
        elapsed_s = time.monotonic() - started
    finally:
        root.removeHandler(handler)
    # a new view every 0.2 s, but never more than 4 redraws a second
    assert 2 <= app.num_frames <= 4 * elapsed_s + 1
    screen = out.getvalue()
    # each redraw is one whole frame (the first draw, before any view, says it is reading)
    assert app.num_frames <= screen.count("run demo") <= app.num_frames + 1
    assert screen.startswith(ENTER_ALT_SCREEN) or ENTER_ALT_SCREEN in screen[:50]
    assert screen.rstrip().endswith(LEAVE_ALT_SCREEN) or LEAVE_ALT_SCREEN in screen[-50:]
    for peer_id in sample.PEERS:
        assert peer_id[:8] in screen
    assert "a warning while the screen is live" in logs.getvalue()  # printed after


def test_quit_key_handler_and_refresh_bound():
    with pytest.raises(ConfigError, match="refresh_per_s"):
        MonitorConfig(refresh_per_s=30)
    with pytest.raises(ConfigError, match="interval_s"):
        MonitorConfig(interval_s=0)
    quits = []
    app = LiveApp(
        CountingReader(),
        config=MonitorConfig(run_id="demo"),
        console=Console(file=io.StringIO()),
        on_quit=lambda: quits.append(True),
    )
    app._quit()
    assert quits == [True]


def test_a_failed_read_is_logged_and_the_next_one_shows(caplog):
    calls = []

    def flaky() -> concurrent.futures.Future:
        calls.append(1)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if len(calls) == 1:
            future.set_exception(ValueError("a malformed answer"))
        else:
            future.set_result(sample.sample_view())
        return future

    out = io.StringIO()
    app = LiveApp(
        flaky,
        config=MonitorConfig(run_id="demo", interval_s=0.1),
        console=Console(file=out, force_terminal=False, width=300),
    )
    with caplog.at_level(logging.WARNING, logger="monitor.app"):
        run_for(app, 0.8)
    assert "reading the swarm failed: a malformed answer" in caplog.text
    assert "run=demo epoch=7" in out.getvalue()
