"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest

from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig


@pytest.fixture
async def make_transport():
    """Start real HttpTransports on 127.0.0.1 (port 0); all are closed at teardown.

    Call as ``await make_transport(config=None, handlers=None, streams=None)``.
    """
    started: list[HttpTransport] = []

    async def factory(config: TransportConfig | None = None, *, rpc=None, streams=None):
        transport = HttpTransport(PeerIdentity.generate(), config or TransportConfig())
        for name, handler in (rpc or {}).items():
            transport.add_rpc_handler(name, handler)
        for name, handler in (streams or {}).items():
            transport.add_stream_handler(name, handler)
        await transport.start()
        started.append(transport)
        return transport

    yield factory
    for transport in started:
        await transport.close()
