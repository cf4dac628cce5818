"""One event loop per process, in a thread of its own, and a blocking way to reach it.

The training loop runs in the main thread (as PyTorch users expect); networking runs on this loop.
:meth:`EventLoopThread.run` is the small blocking facade: it submits a coroutine to the loop and
waits for its result with a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from dht.errors import RequestTimeoutError

T = TypeVar("T")


class EventLoopThread:
    """An asyncio loop running in a daemon thread; ``close`` is safe to call twice."""

    def __init__(self, name: str = "vp-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result, waiting at most ``timeout_s``."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EventLoopThread.run called from its own loop; await instead")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise RequestTimeoutError(f"operation took longer than {timeout_s} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting; the caller owns the returned future
        (cancelling it cancels the coroutine; :meth:`close` cancels what is still running)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EventLoopThread.submit called from its own loop; use a task")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what is left on the loop, stop it and join the thread."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
