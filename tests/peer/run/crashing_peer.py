"""``peer join`` that SIGKILLs itself in the middle of an all-reduce: once its outgoing streams
have carried ``VP_TEST_CRASH_AFTER_BYTES`` bytes, at the next chunk it sends (fault injection by
wrapping the real transport; everything else is the unchanged peer)."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import asynccontextmanager

import dht.launch
from dht.http import HttpTransport
from peer.cli.main import main

CRASH_AFTER_BYTES = int(os.environ["VP_TEST_CRASH_AFTER_BYTES"])


class _CrashingStream:
    def __init__(self, inner, transport: CrashingTransport):
        self._inner, self._transport = inner, transport

    async def send(self, chunk) -> None:
        self._transport.sent_bytes += len(chunk)
        if self._transport.sent_bytes > CRASH_AFTER_BYTES:
            os.kill(os.getpid(), signal.SIGKILL)
        await self._inner.send(chunk)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class CrashingTransport(HttpTransport):
    sent_bytes = 0

    @asynccontextmanager
    async def open_stream(self, address, name, header, *, timeout_s=None):
        async with super().open_stream(address, name, header, timeout_s=timeout_s) as stream:
            yield _CrashingStream(stream, self)


if __name__ == "__main__":
    dht.launch.HttpTransport = CrashingTransport
    sys.exit(main(sys.argv[1:]))
