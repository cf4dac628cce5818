"""Identity is proven, not claimed: attacks on who a request is from, and where it goes.

Honest DHT nodes run as processes (``net_worker.py``); averaging peers run in this process on
their own servers (real sockets). The attacker speaks the wire protocol by hand
(:class:`tests.adversarial.harness_net.WireClient`) from another loopback address.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from averaging.allreduce.protocol import PartHeader
from averaging.matchmaking.group import GroupMember
from dht.net.wire import pack
from tests.adversarial.harness_net import (
    ATTACKER_HOST,
    WireClient,
    assert_no_crashes,
    assert_serving,
    header_frame,
    info_when,
    node_processes,  # noqa: F401 - a fixture
)
from tests.averaging.conftest import (
    exact_mean,
    fast_config,
    make_group,
    make_peers,  # noqa: F401 - a fixture
    make_swarm,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.timeout(120)
KEY = "swarm-key-for-the-adversarial-tests"


async def test_spoofed_ping_cannot_rewrite_another_nodes_routing_entry(node_processes):  # noqa: F811
    a, b = await node_processes(2)
    info = await info_when(a, lambda i: i["routing"])  # B is pinged back before it is added
    assert info["routing"] == {b.peer_id: b.address}
    async with WireClient(local_host=ATTACKER_HOST) as attacker:
        trap = f"http://{ATTACKER_HOST}:9"
        # B's id claimed in the header, the attacker's address in the body: refused, unproven.
        spoofed = await attacker.rpc(
            a.address, "dht.ping", pack({"addr": trap}), extra_headers={"x-vp-peer": b.peer_id}
        )
        assert spoofed.status == 401, spoofed
        # Its own id, B's address: answered, but the address is pinged back before it is
        # believed, B answers there as B, and the claim goes nowhere.
        for _ in range(3):
            claimed = await attacker.rpc(a.address, "dht.ping", pack({"addr": b.address}))
            assert claimed.status == 200
            assert claimed.message()["peer_id"] == a.peer_id
    await assert_serving([b, a], "after-spoofed-pings")
    routing = (await a.ask({"cmd": "info"}))["routing"]
    assert routing == {b.peer_id: b.address}, "B's entry is intact and the attacker got none"
    assert_no_crashes([a, b])


@pytest.mark.parametrize("swarm_key", [None, KEY], ids=["open swarm", "swarm key"])
async def test_a_request_cannot_be_replayed_to_the_same_or_another_node(
    node_processes,  # noqa: F811
    swarm_key,
):
    transport = {"swarm_key": swarm_key} if swarm_key else {}
    a, b = await node_processes(2, transport=transport)
    key = swarm_key.encode() if swarm_key else None
    async with WireClient(swarm_key=key, local_host=ATTACKER_HOST) as member:
        session = await member.hello(a.address)
        path, body = "/v2/rpc/dht.find", pack({"addr": None, "key": b"k" * 20, "value": True})
        headers = member.sign(session, path, body)
        assert (await member.post(a.address + path, body, headers)).status == 200
        again = await member.post(a.address + path, body, headers)
        assert (again.status, "replayed" in again.reason) == (401, True)
        elsewhere = await member.post(b.address + path, body, headers)
        assert (elsewhere.status, "unknown session" in elsewhere.reason) == (401, True)
        # the session's MAC covers the path too: the same headers on another RPC are refused
        other_path = "/v2/rpc/dht.store"
        moved = await member.post(a.address + other_path, body, member.sign(session, path, body))
        assert (moved.status, moved.reason) == (401, "wrong request MAC")
    await assert_serving([a, b], "after-replays")
    assert_no_crashes([a, b])


async def _spam(send, done: asyncio.Event, answers: list) -> None:
    while not done.is_set():
        answers.append(await send())
        await asyncio.sleep(0.005)


async def test_join_and_leave_under_another_peers_id_are_refused(make_swarm):  # noqa: F811
    rng = np.random.default_rng(5)
    vectors = [rng.standard_normal(2000).astype(np.float32) for _ in range(3)]
    peers = await make_swarm([[v.copy()] for v in vectors], config=fast_config(min_group_size=3))
    key = peers[0].averager.matchmaking_key(0)
    done = asyncio.Event()
    spoofed, own = [], []
    async with WireClient(local_host=ATTACKER_HOST) as attacker:
        sessions = {p.address: await attacker.hello(p.address) for p in peers}

        async def leave_as(victim, target):
            return await attacker.rpc(
                target.address, "averaging.t.wait", pack({"key": key, "leave": True}),
                session=sessions[target.address], extra_headers={"x-vp-peer": victim.peer_id},
            )  # fmt: skip

        async def join_as(victim, target):  # its own proven id, the victim's seat
            member = GroupMember(victim.peer_id, victim.address, 1.0, 1.0).to_wire()
            request = {"key": key, "member": member, "remaining_s": 5.0, "numel": 2000}
            return await attacker.rpc(
                target.address, "averaging.t.join", pack(request), session=sessions[target.address]
            )

        attacks = [
            _spam(lambda v=v, t=t: leave_as(v, t), done, spoofed)
            for v in peers for t in peers if v is not t
        ] + [
            _spam(lambda v=v, t=t: join_as(v, t), done, own)
            for v in peers for t in peers if v is not t
        ]  # fmt: skip
        tasks = [asyncio.create_task(a) for a in attacks]
        try:
            results = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=0) for p in peers))
        finally:
            done.set()
            await asyncio.gather(*tasks)
    # refused: 401, or 429 once the spam is past its address's share of requests
    assert spoofed and {a.status for a in spoofed} <= {401, 429}, {a.status for a in spoofed}
    assert any(a.status == 401 for a in spoofed)
    served = [a for a in own if a.status == 200]
    assert served and {a.status for a in own} <= {200, 429}, {a.status for a in own}
    # the leader reads the proven sender: a seat for someone else is never given
    assert "accepted" not in {a.message()["status"] for a in served}
    expected = exact_mean(vectors, [1.0, 1.0, 1.0])
    for peer, result in zip(peers, results, strict=True):
        assert result.status == "ok" and len(result.members) == 3, result
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)


async def test_part_streams_under_a_members_id_are_refused(make_peers):  # noqa: F811
    rng = np.random.default_rng(6)
    size = 30_000
    vectors = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    peers = await make_peers([[v.copy()] for v in vectors], config=fast_config())
    group = make_group(peers, weights, chunk_numel=4096)
    parts = [p for p in group.parts(size) if p.numel]
    done = asyncio.Event()
    answers: list = []
    async with WireClient(local_host=ATTACKER_HOST) as attacker:

        async def forged_part(victim, part):
            # a malformed part under the victim's id would, if believed, drop it from the round
            header = PartHeader(group.group_id, part.index, 1.0, part.numel + 1,
                                group.compression, part.chunk_numel).to_wire()  # fmt: skip
            session = await attacker.hello(group.members[part.index].address)
            path = "/v2/stream/averaging.t.part"
            headers = attacker.sign(session, path, pack(header))
            headers["x-vp-peer"] = victim.peer_id
            url = group.members[part.index].address + path
            return await attacker.post(url, header_frame(header), headers)

        tasks = [
            asyncio.create_task(_spam(lambda v=v, p=p: forged_part(v, p), done, answers))
            for v in peers for p in parts
        ]  # fmt: skip
        try:
            results = await asyncio.gather(*(p.averager.step_in_group(group) for p in peers))
        finally:
            done.set()
            await asyncio.gather(*tasks)
    assert answers and all(a.status == 401 for a in answers), {a.status for a in answers}
    expected = exact_mean(vectors, weights)
    for peer, result in zip(peers, results, strict=True):
        assert result.status == "ok" and not result.dropped_peers, result
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
