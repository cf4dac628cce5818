"""Requests through a relay count against their caller's shares: at the relay under the
caller's own address, at the relayed peer under the address the relay passed (a hint, charged
as ``relayed/{address}``, never taken for a source address), real servers on loopback."""

from __future__ import annotations

import pytest

from dht.net.config import TransportConfig
from dht.net.door import RELAYED_FOR_HEADER, relayed_share_host
from dht.net.wire import pack
from tests.adversarial.harness_net import WireClient
from tests.dht.reach.test_relay import relayed_pair

pytestmark = pytest.mark.timeout(60)
OTHER_HOST = "127.0.0.2"  # another loopback address: the node's address shares are contended


async def where(ctx, payload):
    """What the relayed peer's handler learns of its caller."""
    return {"sender": ctx.sender, "remote_host": ctx.remote_host}


def address_keys(transport) -> set[str]:
    return set(transport.server.requests.addresses._buckets)


async def test_the_relayed_peer_charges_the_address_the_relay_saw_never_the_callers_claim(
    make_transport,
):
    _relay, hidden, _caller, address = await relayed_pair(make_transport, rpc={"where": where})
    async with WireClient() as client:
        session = await client.hello(address)
        answer = await client.rpc(
            address, "where", pack(None), session=session,
            extra_headers={RELAYED_FOR_HEADER: "203.0.113.9"},
        )  # fmt: skip
        assert answer.status == 200, answer
        # the hint never becomes the caller's address (claims of it are checked against that)
        assert answer.message() == {"sender": client.peer_id, "remote_host": ""}
        keys = address_keys(hidden)
        assert "relayed/127.0.0.1" in keys and "relayed/203.0.113.9" not in keys, keys
        # sent straight to the relayed peer's own port, the header is not a hint at all
        direct = hidden._local_url()
        session = await client.hello(direct)
        answer = await client.rpc(
            direct, "where", pack(None), session=session,
            extra_headers={RELAYED_FOR_HEADER: "198.51.100.7"},
        )  # fmt: skip
        assert answer.status == 200 and answer.message()["remote_host"] == "127.0.0.1"
        assert not any(key.endswith("198.51.100.7") for key in address_keys(hidden))


async def test_the_relay_charges_forwarded_requests_to_the_callers_address(make_transport):
    relay, hidden, _caller, address = await relayed_pair(
        make_transport,
        TransportConfig(max_requests_per_s_per_address=1.0, request_burst_per_address=20),
        rpc={"where": where},
    )
    async with WireClient(local_host=OTHER_HOST) as other:  # another address was served
        await other.hello(relay.address)
    async with WireClient() as client:
        session = await client.hello(address)
        statuses = []
        for _ in range(40):
            answer = await client.rpc(address, "where", pack(None), session=session)
            statuses.append(answer.status)
            if answer.status == 429:
                break
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, statuses
    assert len(statuses) <= 20, statuses  # within its burst, its hello and these counted
    assert answer.reason.startswith("too many requests from this address"), answer.reason
    assert int(answer.headers["Retry-After"]) >= 1
    assert hidden.server.num_refused == 0  # refused at the relay: the peer never saw it


@pytest.mark.parametrize(
    ("hint", "key"),
    [
        ("203.0.113.9", "relayed/203.0.113.9"),
        ("2001:db8:1:2::/64", "relayed/2001:db8:1:2::/64"),
        ("2001:db8:1:2:3:4:5:6", "relayed/2001:db8:1:2::/64"),  # its /64
        ("::ffff:203.0.113.9", "relayed/203.0.113.9"),
        ("", ""),
        ("not an address", ""),
        ("1" * 80, ""),
    ],
)
def test_a_relayed_hint_is_a_key_of_its_own_or_nothing(hint, key):
    assert relayed_share_host(hint) == key
