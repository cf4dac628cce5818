"""A swarm of 200 peers on the dashboard: the overview fits the terminal (summary, peers per
epoch, the peers needing attention, groups per round), ``--once`` lists every peer, and the keys
page through the whole table to its last peer.

Expected numbers come from the big sample swarm's definition (``sample.crowd_*``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import io
import re
import statistics
import threading
import types

import pytest
from rich.console import Console

from monitor import app as app_module
from monitor.app import LiveApp
from monitor.config import MonitorConfig
from monitor.crowd import epoch_histogram
from monitor.keys import parse_keys
from monitor.render import Dashboard, render_dashboard
from monitor.state import ViewBuilder
from tests.monitor import sample
from tests.monitor.test_render import row_of, screen

pytestmark = pytest.mark.timeout(60)
NUM_PEERS = 200
ROW = re.compile(r"^\*?([0-9a-f]{8}) ")


def peer_rows(lines: list[str]) -> list[str]:
    """Short ids of the peer table's rows, top to bottom."""
    return [m[1] for line in lines if (m := ROW.match(line))]


@pytest.fixture(scope="module")
def peers():
    return sample.crowd_peers(NUM_PEERS)


@pytest.fixture(scope="module")
def view():
    return sample.crowd_view(NUM_PEERS)


def expected_attention(peers: dict) -> list[str]:
    """Most behind first, then replicas that differ, out of date, slowest; by id on ties."""
    differ = sample.crowd_differs(peers)

    def key(item):
        peer_id, (_, epoch, _, rate, age_s, _) = item
        return (epoch - sample.CROWD_EPOCH, peer_id not in differ, age_s <= 10, rate, peer_id)

    return [peer_id[:8] for peer_id, _ in sorted(peers.items(), key=key)]


def expected_rounds(peers: dict) -> tuple[int, int, int]:
    """(ok, partial, failed) round reports of epochs 7-9."""
    ok = partial = failed = 0
    for epoch in sample.CROWD_ROUND_EPOCHS:
        failed += len(sample.crowd_failed(peers, epoch))
        for index, group in enumerate(sample.crowd_groups(peers, epoch)):
            if epoch == 9 and index == 0:
                partial += len(group)
            else:
                ok += len(group)
    return ok, partial, failed


@pytest.mark.parametrize("size", [(80, 40), (160, 40)])
def test_200_peers_fit_with_summary_histogram_attention_and_groups(view, peers, size):
    width, height = size
    lines = screen(view, width, height)
    assert len(lines) <= height and max(map(len, lines)) <= width
    text = "\n".join(lines)
    # the summary: peers, epochs, rate, rounds by status, peers behind, replicas that differ
    epochs = sorted(v[1] for v in peers.values())
    summary = " ".join(lines[:2])
    assert f"{NUM_PEERS} peers" in lines[0]
    median = statistics.median_low(epochs)
    assert f"epoch min {epochs[0]} med {median} max {epochs[-1]}" in summary
    rate = sum(v[3] for v in peers.values())
    assert f"{rate / 1000:.1f}k samples/s" in summary
    ok, partial, failed = expected_rounds(peers)
    assert f"rounds {ok} ok, {partial} partial, {failed} failed" in summary
    behind = sum(epoch < sample.CROWD_EPOCH for epoch in epochs)
    assert behind == 12 and f"{behind} behind" in summary
    assert f"{len(sample.crowd_differs(peers))} replicas differ" in summary
    # one histogram line per epoch, newest first, with its number of peers
    counts = collections.Counter(epochs)
    histogram = [line for line in lines if re.match(r"epoch +\d+ █", line)]
    assert [int(line.split()[1]) for line in histogram] == sorted(counts, reverse=True)
    for line in histogram:
        epoch = int(line.split()[1])
        assert f"█ {counts[epoch]} peers" in line
        lag = sample.CROWD_EPOCH - epoch
        assert (f"{lag} behind" in line) == (lag > 0)
    # the peers needing attention, in order, and how many more there are
    shown = peer_rows(lines)
    assert len(shown) >= 10
    assert shown == expected_attention(peers)[: len(shown)]
    assert f"{len(shown)} of {NUM_PEERS} peers" in text
    assert f"+{NUM_PEERS - len(shown)} more peers" in text
    # groups per round: how many, and their sizes (count×size)
    for epoch in sample.CROWD_ROUND_EPOCHS:
        groups = sample.crowd_groups(peers, epoch)
        sizes = collections.Counter(len(group) for group in groups).most_common()
        cell = f"{len(groups)} groups: " + " ".join(f"{n}×{size}" for size, n in sizes)
        row = row_of(lines, cell)
        assert row.split()[0] == str(epoch)
    assert "46 groups: 45×4 1×3" in text  # epoch 9: 183 peers in fours, 5 failed


def test_once_lists_every_peer(view, peers):
    def read() -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(view)
        return future

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=100)
    LiveApp(read, config=MonitorConfig(run_id="crowd"), console=console).print_once(5.0)
    lines = out.getvalue().splitlines()
    rows = peer_rows(lines)
    assert sorted(rows) == sorted(peer_id[:8] for peer_id in peers)  # each exactly once
    assert "more peers" not in out.getvalue()
    assert f"{NUM_PEERS} peers" in lines[0]
    assert any(re.match(rf"epoch +{sample.CROWD_EPOCH} █", line) for line in lines)


def draw(app: LiveApp) -> list[str]:
    """The live dashboard as the app would draw it now."""
    console = Console(width=80, height=40, record=True, color_system=None, file=io.StringIO())
    console.print(Dashboard(lambda: app.view, lambda: "q quits", lambda: app.scroll.offset))
    return console.export_text().splitlines()


def test_keys_page_through_every_peer_to_the_last(view, peers):
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=40)
    app = LiveApp(lambda: None, config=MonitorConfig(run_id="crowd"), console=console)
    app.view = view
    by_id = sorted(peer_id[:8] for peer_id in peers)
    assert "of 200 peers: most behind" in "\n".join(draw(app))  # the overview first
    assert app.press("down")  # a scrolling key opens the whole table at its top
    first_page = peer_rows(draw(app))
    assert first_page == by_id[: len(first_page)]
    seen = list(first_page)
    for _ in range(NUM_PEERS):  # page down until the table stops moving
        if not app.press("page_down"):
            break
        seen += peer_rows(draw(app))
    lines = draw(app)
    assert len(lines) <= 40
    assert peer_rows(lines)[-1] == by_id[-1]
    assert f"–{NUM_PEERS} of {NUM_PEERS}" in row_of(lines, "all peers")
    assert set(seen) == set(by_id)  # no peer skipped on the way
    assert app.press("home") and peer_rows(draw(app))[0] == by_id[0]
    assert app.press("end") and peer_rows(draw(app))[-1] == by_id[-1]
    assert app.press("escape") and "most behind" in "\n".join(draw(app))
    # a small swarm shows every peer already: the keys leave it as it is
    app.view = sample.sample_view()
    assert not app.press("down") and app.scroll.offset is None


class ScriptedKeyboard:
    """Stands in for the terminal's keys: one scripted chunk per read."""

    def __init__(self, chunks: list[str]):
        self.chunks = collections.deque(chunks)
        self.done = threading.Event()

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass

    def read(self, timeout_s: float) -> str:
        self.done.wait(timeout_s)  # a frame may be drawn between two keys
        return self.chunks.popleft() if self.chunks else "q"


def test_the_live_view_scrolls_with_the_terminals_escape_sequences(view, monkeypatch):
    # End (as xterm sends it), a pause for the redraw, then q
    keyboard = ScriptedKeyboard(["\x1b[F", *[""] * 5, "q"])
    monkeypatch.setattr(app_module, "_Keyboard", keyboard)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, height=40, color_system=None)

    def read() -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(view)
        return future

    quits = []
    app = LiveApp(
        read, config=MonitorConfig(run_id="crowd"), console=console, on_quit=lambda: quits.append(1)
    )
    app.run()
    assert quits == [1]
    assert f"–{NUM_PEERS} of {NUM_PEERS}" in out.getvalue()
    assert max(peer_id[:8] for peer_id in sample.crowd_peers(NUM_PEERS)) in out.getvalue()


def test_keys_are_named_from_what_terminals_send():
    sent = "\x1b[A\x1bOB\x1b[5~\x1b[6~\x1b[H\x1b[4~\x1b[15~jk Gga\x1b"
    assert parse_keys(sent) == [
        "up",
        "down",
        "page_up",
        "page_down",
        "home",
        "end",  # F5 (\x1b[15~) is no key of ours
        "down",
        "up",
        "page_down",
        "end",
        "home",
        "toggle",
        "escape",
    ]
    assert parse_keys("xq") == ["quit"]


def test_the_histogram_puts_old_epochs_together_past_its_rows():
    peers = [types.SimpleNamespace(epoch=epoch) for epoch in (1, 2, 2, 3, 4, 5, 5, 5, 6)]
    assert epoch_histogram(peers, 3) == [(6, False, 1), (5, False, 3), (4, True, 5)]
    assert epoch_histogram(peers, 6) == [
        (e, False, peers_at) for e, peers_at in [(6, 1), (5, 3), (4, 1), (3, 1), (2, 2), (1, 1)]
    ]


@pytest.mark.parametrize("offset", [None, 0, 10_000])
@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 30), (220, 60)])
def test_every_size_fits_with_a_local_peer_on_the_overview_and_the_table(peers, size, offset):
    width, height = size
    local = sorted(peers)[50]
    view = ViewBuilder(MonitorConfig(run_id="crowd"), local_peer_id=local).build(
        progress=sample.progress(peers=peers),
        profiles=sample.profiles(peers=peers),
        rounds=sample.crowd_round_logs(peers),
        states=sample.crowd_states(peers),
        now=sample.NOW,
    )
    console = Console(
        width=width, height=height, record=True, color_system=None, file=io.StringIO()
    )
    console.print(
        render_dashboard(view, width=width, height=height, footer="q quits", peers_offset=offset)
    )
    lines = console.export_text().splitlines()
    assert len(lines) <= height and max(map(len, lines)) <= width
    assert f"{NUM_PEERS} peers" in lines[0]
    if offset is not None:  # past the end: the last page
        assert (peer_rows(lines)[-1] == max(peers)[:8]) == (offset > 0)
