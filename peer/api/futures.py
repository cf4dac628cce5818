"""What ``peer.DHT``'s ``return_future=True`` calls return."""

from __future__ import annotations

import asyncio
import concurrent.futures


class DHTFuture(concurrent.futures.Future):
    """What ``return_future=True`` returns, as hivemind's ``MPFuture``: ``result(timeout)``,
    ``cancel()`` (which cancels the request), ``done()``, and ``await`` inside an event loop."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def chain(inner: concurrent.futures.Future) -> DHTFuture:
    outer = DHTFuture()

    def copy(done: concurrent.futures.Future) -> None:
        if outer.done():
            return
        try:
            if done.cancelled():
                outer.cancel()
            elif done.exception() is not None:
                outer.set_exception(done.exception())
            else:
                outer.set_result(done.result())
        except concurrent.futures.InvalidStateError:  # cancelled by its owner meanwhile
            pass

    inner.add_done_callback(copy)
    outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
    return outer
