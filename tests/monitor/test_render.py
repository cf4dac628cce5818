"""The dashboard rendered to a recording rich Console: what a viewer reads, at 80x24 and 160x48.

The expected numbers are computed here from the sample swarm's definition (``sample.py``), not
read back from the code under test.
"""

from __future__ import annotations

import statistics

import pytest
from rich.console import Console

from monitor.config import MonitorConfig
from monitor.render import render_dashboard
from monitor.state import ViewBuilder
from monitor.widgets import GROUP_STYLE, split_cells
from tests.monitor import sample

pytestmark = pytest.mark.timeout(60)
LEFT = "e5" * 32  # a peer seen in the previous read only: it left


def screen(view, width: int, height: int | None) -> list[str]:
    console = Console(
        width=width, height=height or 200, record=True, color_system=None, file=_Null()
    )
    console.print(render_dashboard(view, width=width, height=height, footer="q quits"))
    return console.export_text().splitlines()


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def expected_bar(shares: tuple[float, ...], width: int) -> str:
    glyphs = [glyph for glyph, _ in GROUP_STYLE.values()]
    # independent of split_cells for the shares used here: they all round exactly
    cells = [round(share * width) for share in shares]
    assert sum(cells) == width
    return "".join(glyph * count for glyph, count in zip(glyphs, cells, strict=True))


def expected_samples() -> int:
    """Samples toward the target: the peers at the swarm's epoch (7), extrapolated by their
    rate over their record's age (at most 10 s)."""
    total = 0.0
    for _, epoch, samples, rate, age_s, _ in sample.PEERS.values():
        if epoch == 7:
            total += samples + rate * min(age_s, 10.0)
    return int(total)


def row_of(lines: list[str], needle: str) -> str:
    found = [line for line in lines if needle in line]
    assert found, f"{needle!r} not on screen:\n" + "\n".join(lines)
    return found[0]


@pytest.fixture
def view():
    return sample.sample_view(previous_peers={**sample.PEERS, LEFT: sample.PEERS["a1" * 32]})


def test_80x24_fits_and_shows_peers_progress_bars_rounds_and_alerts(view):
    lines = screen(view, 80, 24)
    assert len(lines) <= 24 and max(map(len, lines)) <= 80
    text = "\n".join(lines)
    # header: run, epoch, peers, progress toward the target batch size
    assert "run demo" in lines[0] and "epoch 7" in lines[0] and "4 peers (1 client)" in lines[0]
    rate = sum(rate for _, _, _, rate, _, _ in sample.PEERS.values())
    eta_s = (sample.TARGET - expected_samples()) / rate
    percent = 100 * expected_samples() / sample.TARGET
    progress = f"{expected_samples():,}/{sample.TARGET:,} samples {percent:.0f}% · ETA {eta_s:.2f}s"
    assert progress in lines[1]
    assert f"{rate / 1000:.1f}k samples/s" in lines[0]
    # every peer, its address or "client", and its phase bar (10 cells at 80 columns)
    for peer_id, (address, _, _, _, _, shares) in sample.PEERS.items():
        row = row_of(lines, peer_id[:8])
        assert (address.split("://")[1] if address else "client") in row
        if shares == (0.05, 0.7, 0.15, 0.1):  # rounds to 11 cells: split by largest remainder
            continue
        assert expected_bar(shares, 10) in row
    # d4 is two epochs behind: its epoch shows the lag
    assert "5-2" in row_of(lines, "d4d4d4d4")
    # the newest round: epoch 6, a group of 2 of 4 peers, one dropped, 2/3 averaged, failed
    newest = row_of(lines, "2/4")
    assert newest.split()[0] == "6" and "67%" in newest and "failed" in newest
    older = [line.split() for line in lines if line.split()[:2] == ["5", "3/4"]]
    assert older and older[0][-1] == "ok" and "100%" in older[0]
    # loss now: the mean of the peers' profile losses (0.5, 0.6, 0.7, 0.8)
    assert f"loss {statistics.fmean([0.5, 0.6, 0.7, 0.8]):.3f}" in text
    assert "bottleneck compute (3/4 peers)" in text
    # alerts: behind, silent, the failed round
    assert "peer d4d4d4d4 behind: epoch 5, swarm at 7" in text
    assert "round failed on c3c3c3c3: no group formed" in text
    assert "q quits" in lines[-1]


def test_160x48_uses_the_width_for_more_columns_a_chart_and_notes(view):
    lines = screen(view, 160, 48)
    assert len(lines) <= 48 and max(map(len, lines)) <= 160
    text = "\n".join(lines)
    assert "Volunteer Peer" in lines[0]
    assert f"{expected_samples():,}/{sample.TARGET:,}" in lines[1]
    # wide peers table: samples, loss, 20-cell bars, cpu, rss and notes
    for peer_id, (_, _, samples, _, _, shares) in sample.PEERS.items():
        row = row_of(lines, peer_id[:8])
        assert f" {samples} " in row
        cells = split_cells(list(shares), 20)
        glyphs = [glyph for glyph, _ in GROUP_STYLE.values()]
        assert "".join(g * c for g, c in zip(glyphs, cells, strict=True)) in row
        assert "95%" in row and "300.0M" in row
    assert expected_bar((0.1, 0.6, 0.2, 0.1), 20) in row_of(lines, "a1a1a1a1")
    # c3 trains at 250 samples/s, under half the median of 900, 800, 700, 250 (750)
    assert "straggler" in row_of(lines, "c3c3c3c3")
    assert "behind" in row_of(lines, "d4d4d4d4") and "out of date" in row_of(lines, "d4d4d4d4")
    # rounds with the swarm share and the loss each round ended with (2.3 - 0.25 * epoch)
    newest = row_of(lines, "2/4 50%")
    assert newest.split()[0] == "6" and f"{2.3 - 0.25 * 6:.3f}" in newest
    assert "3/4 75%" in row_of(lines, f"{2.3 - 0.25 * 5:.3f}")
    assert "loss over time" in text
    assert "peer e5e5e5e5 left (epoch 7)" in text
    assert "partial round on a1a1a1a1 (67% averaged, 1 dropped)" in text


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_each_peer_shows_its_path_direct_relayed_or_client(size):
    relay = "http://10.0.0.1:9400"
    peers = dict(sample.PEERS)
    peers["b2" * 32] = (f"{relay}/v2/relay/{'b2' * 32}", *peers["b2" * 32][1:])
    builder = ViewBuilder(MonitorConfig(run_id="demo"))
    view = builder.build(
        progress=sample.progress(peers=peers),
        profiles=sample.profiles(peers=peers),
        rounds=[],
        now=sample.NOW,
    )
    lines = screen(view, *size)
    assert len(lines) <= size[1] and max(map(len, lines)) <= size[0]
    assert "4 peers (1 client, 1 relayed)" in lines[0]
    # the relay's address for a relayed peer, "client" for one with no address
    assert "via 10.0.0.1:9400" in row_of(lines, "b2b2b2b2")
    assert "127.0.0.1:40001" in row_of(lines, "a1a1a1a1")
    assert row_of(lines, "c3c3c3c3").split()[1] == "client"
    if size[0] >= 160:  # wide: a path column too
        expected = {"a1": "direct", "b2": "relayed", "c3": "client", "d4": "direct"}
        for short, path in expected.items():
            assert row_of(lines, short * 4).split()[2 if short != "b2" else 3] == path


def test_the_local_peer_gets_its_own_panel():
    local = "a1" * 32
    view = sample.sample_view(local_peer_id=local)
    narrow = screen(view, 80, 24)
    assert len(narrow) <= 24
    assert "*a1a1a1a1" in row_of(narrow, "127.0.0.1:40001")
    assert "this peer a1a1a1a1 · epoch 7 · 900 samples/s" in row_of(narrow, "this peer")
    assert "fwd 60%" in row_of(narrow, "phases data 10%")
    wide = screen(view, 160, 48)
    assert len(wide) <= 48
    # one bar per phase: forward has 60% of the cells
    assert row_of(wide, "forward ").rstrip().endswith("60%")
    assert row_of(wide, "allreduce ").rstrip().endswith("20%")
    assert "this peer" in row_of(wide, "*a1a1a1a1")


@pytest.mark.parametrize("size", [(80, 24), (160, 48), (100, 30)])
def test_a_big_swarm_still_fits_and_says_how_many_are_hidden(size):
    width, height = size
    shares = (0.1, 0.7, 0.1, 0.1)
    peers = {
        f"{i:02x}" * 32: (f"http://10.0.0.{i}:4000", 3, 10 * i, 100.0 + i, 1.0, shares)
        for i in range(40)
    }
    builder = ViewBuilder(MonitorConfig(run_id="big"))
    view = builder.build(
        progress=sample.progress(peers=peers),
        profiles=sample.profiles(peers=peers),
        rounds=sample.round_logs(),
        now=sample.NOW,
    )
    lines = screen(view, width, height)
    assert len(lines) <= height and max(map(len, lines)) <= width
    shown = sum(any(f"{i:02x}" * 4 in line for line in lines) for i in range(40))
    assert 1 <= shown < 40
    assert f"+{40 - shown} more peers" in "\n".join(lines)
    assert "40 peers" in lines[0]


def test_samples_past_the_target_show_a_full_bar_and_no_wait():
    builder = ViewBuilder(MonitorConfig(run_id="due", target_batch_size=1000))
    view = builder.build(progress=sample.progress(), profiles=[], rounds=[], now=sample.NOW)
    assert expected_samples() > 1000
    assert "1,000/1,000 samples 100% · ETA 0.00s" in screen(view, 80, 24)[1]


def test_without_records_the_screen_says_what_is_missing():
    view = ViewBuilder(MonitorConfig(run_id="empty")).build(
        progress=[], profiles=[], rounds=[], now=sample.NOW, error="no answer within 10 s"
    )
    text = "\n".join(screen(view, 80, 24))
    assert "no peers yet" in text
    assert "target not published yet" in text
    assert "rounds: none reported yet" in text
    assert "DHT read failed: no answer within 10 s" in text


@pytest.mark.parametrize("local", [None, "a1" * 32])
@pytest.mark.parametrize("size", [(80, 24), (100, 30), (119, 40), (120, 30), (132, 43), (220, 60)])
def test_every_terminal_size_fits(size, local):
    width, height = size
    view = sample.sample_view(
        local_peer_id=local, previous_peers={**sample.PEERS, LEFT: sample.PEERS["a1" * 32]}
    )
    lines = screen(view, width, height)
    assert len(lines) <= height and max(map(len, lines)) <= width
    assert all(peer_id[:8] in "\n".join(lines) for peer_id in sample.PEERS)
