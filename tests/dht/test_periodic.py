"""A background task never dies silently: it logs, counts and retries with backoff."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dht.periodic import Periodic

pytestmark = pytest.mark.timeout(20)


async def test_a_failing_action_is_logged_once_counted_and_retried(caplog):
    calls = []
    done = asyncio.Event()

    async def action():
        calls.append(1)
        if len(calls) <= 3:
            raise ValueError("not a DHT error")
        if len(calls) == 5:
            done.set()

    periodic = Periodic(action, 0.005, "flaky")
    with caplog.at_level(logging.DEBUG, logger="dht.periodic"):
        periodic.start()
        await asyncio.wait_for(done.wait(), 10)
        await periodic.stop()
    assert periodic.num_failures == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is not None
    assert "flaky failed (1 in a row" in warnings[0].getMessage()
    await periodic.stop()  # safe twice
