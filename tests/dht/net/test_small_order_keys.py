"""A hello under a small-order or non-canonical Ed25519 key is refused by a real server: a 401
whose reason names the problem, before any signature is checked (under the identity point one
forged signature verifies for every message)."""

from __future__ import annotations

import os
import time

import pytest

from dht.net.client import HELLO_PATH
from dht.net.session import HelloRequest
from dht.net.wire import pack
from tests.adversarial.harness_net import WireClient
from tests.dht.test_identity import NON_CANONICAL_KEYS, SMALL_ORDER_KEYS

pytestmark = pytest.mark.timeout(60)
FORGED_SIG = bytes.fromhex("01" + "00" * 31) + bytes(32)  # R = identity, S = 0


async def test_each_small_order_key_is_refused_at_the_handshake(make_transport):
    node = await make_transport()
    async with WireClient() as client:
        for peer_id in SMALL_ORDER_KEYS + NON_CANONICAL_KEYS:
            hello = HelloRequest(peer_id, os.urandom(32), round(time.time(), 3), os.urandom(16),
                                 FORGED_SIG)  # fmt: skip
            answer = await client.post(
                node.address + HELLO_PATH,
                pack(hello.to_wire()),
                {"content-type": "application/msgpack"},
            )
            assert answer.status == 401, (peer_id, answer.status, answer.reason)
            assert "not a usable Ed25519 key" in answer.reason, answer.reason
            assert ("small-order" in answer.reason) == (peer_id in SMALL_ORDER_KEYS)
        await client.hello(node.address)  # an honest key still makes a session
