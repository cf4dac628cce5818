"""The request-rate shares (token buckets per peer and per address), on a clock the test sets,
and through a real server: a sender past its share is refused at the door with a reason and a
Retry-After, and one that ignores it waits for its next refusal."""

from __future__ import annotations

import math
import time

import pytest

from dht.errors import ConfigError
from dht.net.client import HELLO_PATH
from dht.net.config import TransportConfig
from dht.net.request_shares import RateShares, RequestShares, TokenBuckets
from dht.net.session import PendingHello
from dht.net.wire import pack
from tests.adversarial.harness_net import WireClient


def test_a_bucket_serves_its_burst_then_its_rate():
    shares = RateShares(rate_per_s=10, burst=3, max_hold_s=1.0, holder="peer")
    assert [shares.take("a", now_s=0.0) for _ in range(3)] == [None] * 3
    refusal = shares.take("a", now_s=0.0)
    assert refusal is not None and refusal.retry_after_s == 1 and refusal.hold_s == 0
    assert "share is 10 a second" in refusal.reason
    assert shares.take("b", now_s=0.0) is None  # another key has its own bucket
    assert shares.take("a", now_s=0.15) is None  # refilled at 10 a second


def test_a_sender_that_ignores_retry_after_is_held_until_then():
    shares = RateShares(rate_per_s=10, burst=1, max_hold_s=0.5, holder="peer")
    shares.take("a", now_s=0.0)
    first = shares.take("a", now_s=0.0)
    assert first.hold_s == 0  # told: retry after 1 s
    again = shares.take("a", now_s=0.01)  # ignored it
    assert again.hold_s == 0.5 and shares.num_held == 1


def test_an_address_alone_is_not_refused_for_its_rate():
    shares = RateShares(rate_per_s=1, burst=1, max_hold_s=1.0, holder="address",
                        contention_window_s=10.0)  # fmt: skip
    assert all(shares.take("a", now_s=0.0) is None for _ in range(50))
    assert shares.take("b", now_s=1.0) is None  # another address came
    assert shares.take("a", now_s=1.0) is None  # the token of its second
    assert shares.take("a", now_s=1.0) is not None  # and now the share applies
    assert all(shares.take("a", now_s=20.0 + i) is None for i in range(5))  # alone again


def test_work_done_is_charged_as_debt_and_drain_empties_a_bucket():
    shares = _request_shares(rate_per_s=10, burst=10)
    shares.charge_body("p", "", 15)  # a large body: 15 requests' worth, 10 at most in debt
    assert shares.take_peer("p") is not None
    assert shares.take_peer("q") is None
    assert shares.drain("q") == 1 and shares.take_peer("q") is not None


def _request_shares(*, rate_per_s: float, burst: float, hello_burst: float = 10) -> RequestShares:
    return RequestShares(rate_per_s_per_peer=rate_per_s, burst_per_peer=burst,
                         rate_per_s_per_address=rate_per_s, burst_per_address=burst,
                         handshakes_per_s_per_address=rate_per_s, handshake_burst=hello_burst,
                         max_hold_s=1.0, contention_window_s=10.0)  # fmt: skip


def test_a_handshake_counts_as_a_request_of_its_address_and_as_a_handshake():
    # refills slow enough that a loaded machine sees one burst
    shares = _request_shares(rate_per_s=0.01, burst=5, hello_burst=3)
    assert shares.take_address("10.0.0.9") is None  # another address: the share applies
    hellos = [shares.take_hello("10.0.0.1") for _ in range(4)]
    assert hellos[:3] == [None] * 3
    assert hellos[3].reason.startswith("too many handshakes from this address")
    assert shares.take_address("10.0.0.1") is None  # 3 hellos and this: 4 of the 5 requests
    assert shares.take_hello("10.0.0.1").reason.startswith("too many requests from this address")
    assert shares.take_address("10.0.0.9") is None  # the other address has its own share
    # an IPv6 /64 is one address; a relayed hello ("") is not counted here
    assert shares.take_hello("2001:db8::1") is None
    assert [shares.take_hello("2001:db8::2") for _ in range(2)] == [None, None]
    assert shares.take_hello("2001:db8::3") is not None
    assert all(shares.take_hello("") is None for _ in range(20))
    assert not shares.hellos.allow("10.0.0.1")  # the relay's count of forwarded hellos


def test_token_buckets_refuse_more_than_a_burst_and_say_how_long_to_wait():
    buckets = TokenBuckets(rate_per_s=100, burst=200)
    assert buckets.shortfall_s("a", 150, now_s=0.0) == 0
    assert buckets.shortfall_s("a", 100, now_s=0.0) == pytest.approx(0.5)
    assert math.isinf(buckets.shortfall_s("a", 201, now_s=0.0))


@pytest.mark.parametrize(
    "name",
    [
        "max_requests_per_s_per_peer",
        "max_refusal_hold_s",
        "request_burst_per_address",
        "request_body_bytes_per_request",
    ],
)
def test_config_refuses_a_share_that_is_not_positive(name):
    with pytest.raises(ConfigError, match=name):
        TransportConfig(**{name: 0})


async def test_a_real_server_refuses_a_peer_past_its_share_at_the_door(make_transport):
    # a slow refill: the test sees one burst, however slowly a loaded machine runs it
    config = TransportConfig(max_requests_per_s_per_peer=0.05, request_burst_per_peer=5,
                             max_refusal_hold_s=0.3)  # fmt: skip
    node = await make_transport(config)
    node.add_rpc_handler("echo", lambda ctx, payload: _echo(payload))
    async with WireClient() as client:
        session = await client.hello(node.address)
        body = pack([1])
        answers = []
        while len(answers) < 20 and (not answers or answers[-1].status == 200):
            answers.append(await client.rpc(node.address, "echo", body, session=session))
        # the burst: 5 tokens, less what the bodies' bytes took (a fraction of one)
        assert [a.status for a in answers] == [200] * 4 + [429]
        assert int(answers[-1].headers["Retry-After"]) >= 1
        assert answers[-1].reason.startswith("too many requests from this peer")
        start = time.monotonic()
        held = await client.rpc(node.address, "echo", body, session=session)
        assert held.status == 429 and time.monotonic() - start >= 0.25  # it ignored Retry-After
    async with WireClient() as other:  # another peer at the same (lone) address is served
        answer = await other.rpc(node.address, "echo", body)
        assert answer.status == 200


async def _echo(payload):
    return payload


async def test_a_real_server_refuses_handshakes_past_their_share_with_a_retry_after(
    make_transport,
):
    config = TransportConfig(max_handshakes_per_s_per_address=0.05, handshake_burst=2,
                             max_refusal_hold_s=0.3)  # fmt: skip
    node = await make_transport(config)
    async with WireClient() as client:
        for _ in range(2):
            await client.hello(node.address)
        body = pack(PendingHello(client.identity).request.to_wire())
        refused = await client.post(node.address + HELLO_PATH, body, {})
        assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.reason.startswith("too many handshakes from this address")
        start = time.monotonic()
        with pytest.raises(AssertionError, match="429"):  # it ignored the Retry-After: held
            await client.hello(node.address)
        assert time.monotonic() - start >= 0.25
    assert node.server.requests.hellos.num_held == 1


def test_an_address_and_the_same_address_through_a_relay_do_not_contend():
    """A swarm on one host, some of it relayed: its callers are one source, whose share never
    applies while it is alone; a relayed caller from another address does contend."""
    shares = RateShares(rate_per_s=1.0, burst=2, max_hold_s=1.0, holder="address",
                        contention_window_s=10.0)  # fmt: skip
    now_s = 100.0
    for i in range(20):
        key = "relayed/127.0.0.1" if i % 2 else "127.0.0.1"
        assert shares.take(key, now_s) is None
    assert shares.take("relayed/127.0.0.2", now_s) is None
    assert shares.take("127.0.0.1", now_s) is not None  # contended now, its bucket empty
