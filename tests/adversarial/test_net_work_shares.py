"""Shared work one key or one address could take all of: stream slots and signature checks.

A victim node and an honest node run in their own processes; the attacker speaks the wire by
hand from another loopback address (``127.0.0.2``), first with one key, then with many keys from
that one address. It holds every stream slot it can, or keeps the victim's signature-check queue
full of store requests carrying fresh, validly signed records. The honest peer's pings, streams
and stores are served throughout, its ping p50 within a few times its no-attack value.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from dht.config import get_dht_time
from dht.identity import PeerIdentity
from dht.kademlia.routing import DHTID
from dht.kademlia.validation import owner_subkey, sign_record
from dht.net.config import TransportConfig
from dht.net.session import Session
from dht.net.wire import pack
from tests.adversarial.harness_net import (
    ATTACKER_HOST,
    WireClient,
    assert_no_crashes,
    assert_serving,
    header_frame,
    host_port,
    http_request,
    node_processes,  # noqa: F401 - a fixture
)
from tests.adversarial.test_net_shares import P50_FACTOR, P50_SLACK_S, _open_raw, _status_soon, p50

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
RECORDS_PER_STORE = 64  # the most a store request may carry


async def _held_streams(address: str, num_keys: int, per_key: int) -> tuple[list, list[int]]:
    """``per_key`` ``test.sink`` streams from each of ``num_keys`` fresh keys at the attacker's
    address: the header frame, then nothing (the sink waits for chunks). The connections and
    what was answered at once (0: nothing, the stream holds its slot)."""
    host, port = host_port(address)
    header = {"sink": True}
    writers, statuses = [], []
    for _ in range(num_keys):
        async with WireClient(local_host=ATTACKER_HOST) as client:
            session = await client.hello(address)
            for _ in range(per_key):
                headers = client.sign(session, "/v2/stream/test.sink", pack(header))
                request = http_request("/v2/stream/test.sink", headers, header_frame(header),
                                       content_length=MIB)  # fmt: skip
                reader, writer = await _open_raw(host, port, request)
                writers.append(writer)
                statuses.append(await _status_soon(reader, 0.1))
    return writers, statuses


async def _honest_sink(caller, address: str, num_bytes: int) -> dict:
    async with caller.open_stream(address, "test.sink", {"sink": True}, timeout_s=10) as stream:
        await stream.send(bytes(num_bytes))
        await stream.finish_sending()
        return await stream.reply_header()


async def test_one_key_or_one_address_cannot_take_every_stream_slot(
    node_processes,  # noqa: F811
    make_transport,
):
    """One key holds its 8 streams, ten keys from one address that address's 64; an honest
    peer's streams (another address) and pings are served all the while."""
    victim, honest = await node_processes(2, serve_streams=True)
    caller = await make_transport(TransportConfig(client_mode=True))
    base = p50((await honest.ask({"cmd": "pings", "address": victim.address}))["latencies_s"])
    one_key, statuses = await _held_streams(victim.address, 1, 12)
    assert statuses == [0] * 8 + [429] * 4, statuses
    many_keys, statuses = await _held_streams(victim.address, 9, 8)
    assert statuses.count(0) == 64 - 8 and statuses.count(429) == 72 - 56, statuses
    replies = await asyncio.gather(*(_honest_sink(caller, victim.address, MIB) for _ in range(4)))
    assert replies == [{"bytes": MIB}] * 4
    attacked = (await honest.ask({"cmd": "pings", "address": victim.address}))["latencies_s"]
    await assert_serving([honest, victim], "streams-held")
    for writer in one_key + many_keys:
        writer.close()
    assert p50(attacked) <= P50_FACTOR * base + P50_SLACK_S, (base, attacked)
    assert_no_crashes([victim, honest])
    print(f"stream slots: honest ping p50 {base * 1e3:.1f} ms -> {p50(attacked) * 1e3:.1f} ms")


def _signed_records(identities: list[PeerIdentity], per_key: int) -> list[list]:
    """Fresh, validly signed records (each costs the victim one verification), as store items."""
    expiration = get_dht_time() + 300.0
    items = []
    for identity in identities:
        subkey = owner_subkey(identity.peer_id)
        for i in range(per_key):
            key_id = DHTID.from_key(f"flood/{identity.peer_id[:8]}/{i}")
            value = pack(i)
            record = sign_record(identity, int(key_id), subkey, value, expiration)
            items.append([key_id.to_raw(), subkey, value, expiration, record.signature])
    return items


async def _flood_stores(
    address: str, clients: list[tuple[WireClient, Session]], items: list, num_senders: int
) -> list[int]:
    """``num_senders`` tasks send store requests of 64 fresh records back to back, round robin
    over ``clients``, until every record was checked (a 429 hands its records back)."""
    pending = [items[i : i + RECORDS_PER_STORE] for i in range(0, len(items), RECORDS_PER_STORE)]
    statuses: list[int] = []
    turn = itertools.cycle(clients)

    async def sender() -> None:
        while pending:
            records = pending.pop()
            client, session = next(turn)
            body = pack({"addr": None, "records": records})
            answer = await client.rpc(address, "dht.store", body, session=session)
            statuses.append(answer.status)
            if answer.status == 429:
                pending.insert(0, records)
                await asyncio.sleep(0.005)

    await asyncio.gather(*(sender() for _ in range(num_senders)))
    return statuses


async def _honest_store(address: str) -> tuple[int, float]:
    """An honest 8-record store from the honest address: its status and latency."""
    identity = PeerIdentity.generate()
    items = _signed_records([identity], 8)
    async with WireClient(identity) as client:
        session = await client.hello(address)
        start = time.monotonic()
        answer = await client.rpc(
            address, "dht.store", pack({"addr": None, "records": items}), session=session
        )
        return answer.status, time.monotonic() - start


@pytest.mark.parametrize("num_keys", [1, 16], ids=["one key", "one address, 16 keys"])
async def test_a_flood_of_signatures_to_check_does_not_stop_honest_stores(
    node_processes,  # noqa: F811
    num_keys,
):
    """Store requests of 64 freshly signed records, 12 at a time from one address: the victim
    checks them off its event loop in turns, the attacker beyond its share gets 429 at once,
    and honest pings and stores are served within a few times their no-attack latency."""
    victim, honest = await node_processes(2)
    base = p50((await honest.ask({"cmd": "pings", "address": victim.address}))["latencies_s"])
    base_status, base_store_s = await _honest_store(victim.address)
    assert base_status == 200
    identities = [PeerIdentity.generate() for _ in range(num_keys)]
    items = _signed_records(identities, 6144 // num_keys)
    clients = []
    for identity in identities:
        client = await WireClient(identity, local_host=ATTACKER_HOST).__aenter__()
        clients.append((client, await client.hello(victim.address)))
    try:
        flood = asyncio.create_task(_flood_stores(victim.address, clients, items, 12))
        await asyncio.sleep(0.2)
        attacked = (await honest.ask({"cmd": "pings", "address": victim.address}))["latencies_s"]
        store_status, store_s = await _honest_store(victim.address)
        flood_running = not flood.done()
        statuses = await flood
    finally:
        for client, _ in clients:
            await client.__aexit__()
    assert flood_running, "the flood ended before the honest peer was measured"
    assert store_status == 200
    assert set(statuses) <= {200, 429}, set(statuses)
    assert statuses.count(200) == len(items) // RECORDS_PER_STORE
    if num_keys == 1:
        assert 429 in statuses  # 12 requests of 64 do not fit in one peer's share of 256
    assert p50(attacked) <= P50_FACTOR * base + P50_SLACK_S, (base, attacked)
    await assert_serving([victim, honest], f"signatures-{num_keys}")
    assert_no_crashes([victim, honest])
    print(
        f"signature flood ({num_keys} keys, {statuses.count(429)} of {len(statuses)} refused "
        f"429): honest ping p50 {base * 1e3:.1f} ms -> {p50(attacked) * 1e3:.1f} ms, honest "
        f"8-record store {base_store_s * 1e3:.1f} ms -> {store_s * 1e3:.1f} ms"
    )
