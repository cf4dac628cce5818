"""A coroutine function run every few seconds by a task its owner starts and stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 16  # a failing action is retried at most this many intervals apart


class Periodic:
    """Runs ``action`` now and then every ``interval_s`` seconds until :meth:`stop`.

    The task never dies silently: an exception from ``action`` is counted
    (:attr:`num_failures`), logged (a WARNING with its traceback for the first failure of a
    streak, DEBUG for the next ones), and the action is retried after a backoff that doubles
    up to ``MAX_BACKOFF_FACTOR`` intervals; a success ends the streak.
    """

    def __init__(self, action: Callable[[], Awaitable[object]], interval_s: float, name: str):
        self._action = action
        self._interval_s = interval_s
        self._name = name
        self._task: asyncio.Task | None = None
        self.num_failures = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        streak = 0
        while True:
            try:
                await self._action()
                streak = 0
            except Exception as e:  # a background task must go on (and say why it stumbled)
                streak += 1
                self.num_failures += 1
                level = logging.WARNING if streak == 1 else logging.DEBUG
                logger.log(level, "%s failed (%d in a row, %d in all): %r; retrying",
                           self._name, streak, self.num_failures, e,
                           exc_info=streak == 1)  # fmt: skip
            backoff = min(2 ** max(0, streak - 1), MAX_BACKOFF_FACTOR) if streak else 1
            await asyncio.sleep(self._interval_s * backoff)

    async def stop(self) -> None:
        """Cancel the task and wait for it; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
