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
