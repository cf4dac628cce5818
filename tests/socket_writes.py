"""What a test's sockets were handed: the views (not copies) of memory written to a transport."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest


@pytest.fixture
def transport_writes(monkeypatch) -> list[memoryview]:
    """Every view (not bytes) handed to a socket transport's ``write`` while the test runs."""
    writes: list[memoryview] = []
    original = asyncio.selector_events._SelectorSocketTransport.write

    def write(self, data):
        if isinstance(data, memoryview):
            writes.append(data)
        return original(self, data)

    monkeypatch.setattr(asyncio.selector_events._SelectorSocketTransport, "write", write)
    return writes


def bytes_handed_from(writes: list[memoryview], array: np.ndarray) -> int:
    """How many bytes of ``array``'s memory were handed to a transport as views of it."""
    return sum(
        view.nbytes
        for view in writes
        if np.may_share_memory(np.frombuffer(view, dtype=np.uint8), array)
    )
