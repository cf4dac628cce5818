"""An asyncio program on its own event loop, in a thread moved into a network namespace: a peer
behind a NAT router that the test drives from outside."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from pyroute2 import netns


class LoopInNamespace:
    """Runs :meth:`serve` in ``namespace`` until :meth:`stop`.

    A subclass's ``serve`` sets itself up, hands its result to :meth:`started` (what
    :meth:`start` returns) and then awaits :meth:`stopped`.
    """

    def __init__(self, namespace: str):
        self._namespace = namespace
        self._out: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main)

    def start(self, timeout_s: float = 30) -> Any:
        """Start; what ``serve`` handed to :meth:`started` (or raise what it raised)."""
        self._thread.start()
        result = self._out.get(timeout=timeout_s)
        if isinstance(result, BaseException):
            raise result
        return result

    def call(self, function: Callable[[], Awaitable[Any]], timeout_s: float = 30) -> Any:
        """``await function()`` on the program's loop; its result."""
        return asyncio.run_coroutine_threadsafe(function(), self._loop).result(timeout=timeout_s)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def started(self, result: Any) -> None:
        self._out.put(result)

    async def stopped(self) -> None:
        await self._stop.wait()

    async def serve(self) -> None:
        raise NotImplementedError

    def _main(self) -> None:
        try:
            netns.setns(self._namespace, flags=0)
            asyncio.run(self._run())
        except BaseException as e:
            self._out.put(e)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        await self.serve()
