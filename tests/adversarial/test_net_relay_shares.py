"""A flood through a relay: the attacker gets its own address's share, at the relay and at the
relayed peer, and honest callers through the same relay are served.

A relay, a peer reached only through it, and an honest node run in their own processes. The
attacker proves sixteen fresh keys with the relayed peer (through the relay) and sends signed
pings through the relay from another loopback address (``127.0.0.2``) as fast as twelve
connections allow, each refusal retried at once. The relay charges every forwarded request to
the caller's own address (429 with a ``Retry-After`` past its share), and the relayed peer charges
its address shares to the caller's address the relay passed (``relayed/127.0.0.2``), and its peer
shares to each proven key. What the attacker gets served is at most one address's share; every
honest ping through the same relay is answered, its p50 within a few times its own no-attack
value measured in the same test.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter

import aiohttp
import pytest

from dht.net.config import TransportConfig
from dht.net.session import Session
from dht.net.wire import pack
from tests.adversarial.harness_net import (
    ATTACKER_HOST,
    Answer,
    Flood,
    WireClient,
    assert_no_crashes,
    assert_serving,
    node_processes,  # noqa: F401 - a fixture
    refused,
)
from tests.adversarial.test_net_shares import P50_FACTOR, P50_SLACK_S, p50

pytestmark = pytest.mark.timeout(120)
NUM_KEYS = 16
NUM_SENDERS = 12
PINGS_PER_BATCH = 10
BATCH_PAUSE_S = 0.2  # honest pings ~40 a second: well within the honest address's own share
MEASURE_S = 3.0
DEFAULTS = TransportConfig()
# Where the attacker's share binds: at the relay (defaults), or only at the relayed peer (the
# relay's shares of an address made so wide that they never bind).
WIDE_OPEN = {
    "max_requests_per_s_per_address": 1e6,
    "request_burst_per_address": 1_000_000,
    "max_relayed_requests_per_address": 2 * NUM_SENDERS,
    "max_relayed_requests_per_peer": 4 * NUM_SENDERS,
}


def relayed_pings(address: str, clients: list[tuple[WireClient, Session]]):
    """A flood's sender: signed pings through a relay, round robin over the attacker's keys
    request by request; a connection cut is answer 0 (it comes back at once)."""
    body = pack({"addr": None})
    turns = itertools.count()

    async def send(index: int) -> Answer:
        client, session = clients[next(turns) % len(clients)]
        try:
            return await client.rpc(address, "dht.ping", body, session=session)
        except aiohttp.ClientError:
            return Answer(0, {}, b"")

    return send


async def paced_pings(honest, address: str) -> list[float | None]:
    """Honest pings to ``address`` for ``MEASURE_S``, in batches: each latency (None: failed)."""
    latencies: list[float | None] = []
    deadline_s = time.monotonic() + MEASURE_S
    while time.monotonic() < deadline_s:
        answer = await honest.ask({"cmd": "pings", "address": address, "count": PINGS_PER_BATCH})
        latencies += answer["latencies_s"]
        await asyncio.sleep(BATCH_PAUSE_S)
    return latencies


# it compares honest latencies before and during the flood: the parallel part's load, changing in
# between, once made that 10x (3.4 -> 35.6 ms) where alone it is 0.8-1.6x
@pytest.mark.serial
@pytest.mark.parametrize("where", ["relay", "relayed peer"])
async def test_a_flood_through_a_relay_gets_its_address_share_and_honest_callers_are_served(
    node_processes,  # noqa: F811
    where,
):
    relay_transport = WIDE_OPEN if where == "relayed peer" else {}
    (relay,) = await node_processes(1, transport=relay_transport)
    (victim,) = await node_processes(1, initial_peers=[relay.address], relay_urls=[relay.address])
    (honest,) = await node_processes(1, initial_peers=[relay.address])
    assert victim.address == f"{relay.address}/v2/relay/{victim.peer_id}", victim.address
    base = await paced_pings(honest, victim.address)
    clients = []
    for _ in range(NUM_KEYS):
        client = await WireClient(local_host=ATTACKER_HOST).__aenter__()
        clients.append((client, await client.hello(victim.address)))
    flood = Flood(
        relayed_pings(victim.address, clients), is_refusal=refused, num_senders=NUM_SENDERS
    )
    try:
        flood.start()
        await flood.until_refused(10.0, required=False)  # the assertions say if it never was
        attacked = await paced_pings(honest, victim.address)
        await flood.stop()
    finally:
        for client, _ in clients:
            await client.__aexit__()
    statuses = flood.counts(lambda answer: answer.status)
    duration_s = flood.duration_s
    refusals = [answer for answer in flood.outcomes if answer.status == 429]
    # for its rate, or for its share of the relayed peer's request slots at the relay
    reasons = Counter(
        "rate" if a.reason.startswith("too many requests from this address") else
        "slots" if "request slots of this peer" in a.reason else a.reason
        for a in refusals
    )  # fmt: skip
    base_p50, attacked_p50 = p50(base), p50(attacked)
    print(
        f"relayed flood, bound at the {where} ({NUM_KEYS} keys, {duration_s:.1f} s: "
        f"{statuses[200]} served, "
        f"{statuses[429]} refused 429 ({dict(reasons)}): honest ping p50 through "
        f"the relay {base_p50 * 1e3:.2f} ms -> {attacked_p50 * 1e3:.2f} ms "
        f"(x{attacked_p50 / base_p50:.2f})"
    )
    others = {a.reason for a in flood.outcomes if a.status not in (200, 429)}
    assert set(statuses) <= {200, 429}, (statuses, others)
    assert refusals and set(reasons) <= {"rate", "slots"}, reasons
    assert all(int(a.headers["Retry-After"]) >= 1 for a in refusals)
    # However many keys it proved, one address is served at most one address's share of the
    # relay's requests (every refusal counted in it too), or of the relayed peer's.
    rate_per_s = DEFAULTS.max_requests_per_s_per_address
    burst = DEFAULTS.request_burst_per_address
    assert statuses[200] <= burst + rate_per_s * duration_s + NUM_SENDERS, (statuses, duration_s)
    assert attacked_p50 <= P50_FACTOR * base_p50 + P50_SLACK_S, (base_p50, attacked_p50)
    await assert_serving([relay, honest], "relayed-flood")
    assert_no_crashes([relay, victim, honest])
