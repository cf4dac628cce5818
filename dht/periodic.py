"""A coroutine function run every few seconds by a task its owner starts and stops."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Periodic:
    """Runs ``action`` now and then every ``interval_s`` seconds until :meth:`stop`.

    An exception from ``action`` ends the task; :meth:`stop` re-raises it, so a failure is not
    lost.
    """

    def __init__(self, action: Callable[[], Awaitable[object]], interval_s: float, name: str):
        self._action = action
        self._interval_s = interval_s
        self._name = name
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        while True:
            await self._action()
            await asyncio.sleep(self._interval_s)

    async def stop(self) -> None:
        """Cancel the task and wait for it; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
