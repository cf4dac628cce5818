"""A download in progress ends as soon as the peer is told to stop: a silent donor must not hold
a leaving peer for the whole download timeout (``peer join`` got SIGTERM during a download from
a stranger that never answered, and did not exit within a minute)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from peer.swarm.catch_up import StateCatchUp
from peer.swarm.state_sync import StateSyncError

pytestmark = pytest.mark.timeout(30)


def catch_up_with(stop: threading.Event) -> StateCatchUp:
    # only the stop event matters to the wait under test; the rest of a StateCatchUp is a model,
    # an optimizer and services, which these tests do not touch
    state = StateCatchUp.__new__(StateCatchUp)
    state._stop_event = stop
    return state


async def test_a_silent_donor_is_left_when_the_peer_stops():
    stop = threading.Event()
    state = catch_up_with(stop)
    cancelled = asyncio.Event()

    async def silent_donor() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    threading.Timer(0.3, stop.set).start()
    with pytest.raises(StateSyncError, match="stopping"):
        await state._unless_stopped(silent_donor())
    assert cancelled.is_set()  # the download was cancelled and awaited, not left running


async def test_a_download_that_ends_is_returned():
    state = catch_up_with(threading.Event())

    async def donor() -> str:
        await asyncio.sleep(0.3)
        return "snapshot"

    assert await state._unless_stopped(donor()) == "snapshot"


async def test_a_failed_download_raises_its_own_error():
    state = catch_up_with(threading.Event())

    async def donor() -> None:
        raise StateSyncError("no donor delivered")

    with pytest.raises(StateSyncError, match="no donor delivered"):
        await state._unless_stopped(donor())


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s


def catch_up_failing(monkeypatch, outcomes: list[bool]) -> tuple[StateCatchUp, list[int], _Clock]:
    """A StateCatchUp whose downloads fail or work in the order of ``outcomes`` (the donors'
    side is not under test: only when the peer tries again)."""
    clock = _Clock()
    monkeypatch.setattr("peer.swarm.catch_up.time", clock)
    state = catch_up_with(threading.Event())
    state._last_failed_s = -float("inf")
    state._num_failed = 0
    state.replicas = None
    state._overlapped = False
    tries: list[int] = []

    def download(min_epoch: int, *, fallback: int, **_) -> int:
        tries.append(min_epoch)
        return min_epoch if outcomes.pop(0) else fallback

    state._arrival = lambda epoch: epoch
    state._download = download
    state._announce_arrival = lambda epoch: None
    state.snapshot = lambda epoch: None
    state.services = type(
        "Services",
        (),
        {
            "tracker": type("T", (), {"report_local_progress": lambda _, epoch, samples: None})(),
            "state_server": type("S", (), {"update": lambda _, snapshot: None})(),
        },
    )()
    return state, tries, clock


def test_failed_catch_ups_back_off_doubling_and_a_success_resets(monkeypatch):
    state, tries, clock = catch_up_failing(monkeypatch, [False, False, False, True, False])

    def seconds_until_next_try() -> float:
        """Train on in 0.5 s steps, calling catch_up as the training loop does at each."""
        before, waited_s = len(tries), 0.0
        while True:
            state.catch_up(9, epoch=3)
            if len(tries) > before:
                return waited_s
            clock.now_s += 0.5
            waited_s += 0.5

    # the first try is at once; after 1, 2, 3 failures in a row the next waits 2, 4, 8 s;
    # the fourth worked, so a failure after it waits 2 s again
    assert [seconds_until_next_try() for _ in range(5)] == [0.0, 2.0, 4.0, 8.0, 0.0]
    assert state.cooldown_s == 2.0
    assert len(tries) == 5


def test_the_cooldown_stops_growing_at_its_cap():
    from peer.swarm.catch_up import MAX_RESYNC_COOLDOWN_S, retry_cooldown_s

    assert retry_cooldown_s(0) == 0.0
    assert [retry_cooldown_s(n) for n in range(1, 5)] == [2.0, 4.0, 8.0, 16.0]
    assert retry_cooldown_s(10_000) == MAX_RESYNC_COOLDOWN_S
