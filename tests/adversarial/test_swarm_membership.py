"""A group no member can break: a follower announcing another member's address (attack 3).

Real averagers on loopback (their transports and DHT over real sockets) and an attacker with its
own proven key that, in every round, joins every honest leader announcing that leader's address
or another honest peer's, and waits like a follower. On main the duplicate escaped the leader's
``finalize`` (the round failed) and the honest followers' ``wait`` (a 500 with a traceback).
Here the attacker is refused at ``join`` with a reason, every honest round completes with every
honest peer and the exact mean, and no ERROR is logged.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from averaging.matchmaking.group import GroupMember, distinct_members, membership_refusal
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from tests.adversarial.harness_net import is_status_500
from tests.averaging.conftest import exact_mean, fast_config

pytestmark = pytest.mark.timeout(90)
SIZE = 20_000


async def _split_every_group(attacker: HttpTransport, peers, key: str, stop: asyncio.Event):
    """Join each honest peer as a follower that claims another member's address, then wait."""
    answers: list[str] = []
    waits: set[asyncio.Task] = set()
    while not stop.is_set():
        for index, leader in enumerate(peers):
            for victim in (leader, peers[(index + 1) % len(peers)]):
                member = GroupMember(attacker.peer_id, victim.address, 1.0, 1.0)
                request = {"key": key, "member": member.to_wire(), "numel": SIZE,
                           "remaining_s": 3.0}  # fmt: skip
                try:
                    answer = await attacker.call(leader.address, "averaging.t.join", request,
                                                 timeout_s=2)  # fmt: skip
                except Exception as e:  # a refusal is fine; it must be a typed one
                    answers.append(type(e).__name__)
                    continue
                answers.append(answer.get("status"))
                wait = attacker.call(leader.address, "averaging.t.wait", {"key": key},
                                     timeout_s=5)  # fmt: skip
                waits.add(asyncio.ensure_future(wait))
        await asyncio.sleep(0.05)
    results = await asyncio.gather(*waits, return_exceptions=True)
    return answers, results


async def test_a_follower_claiming_another_members_address_splits_nothing(make_swarm, caplog):
    caplog.set_level(logging.WARNING)
    vectors = [np.random.default_rng(i).standard_normal(SIZE).astype(np.float32) for i in range(3)]
    config = fast_config(target_group_size=4, matchmaking_time_s=2.0)
    peers = await make_swarm([[v.copy()] for v in vectors], config=config)
    async with HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True)) as bad:
        for epoch in range(2):
            key = peers[0].averager.matchmaking_key(epoch)
            stop = asyncio.Event()
            attack = asyncio.create_task(_split_every_group(bad, peers, key, stop))
            before = [p.tensors[0].copy() for p in peers]
            results = await asyncio.gather(
                *(p.averager.step(weight=1.0, epoch=epoch) for p in peers)
            )
            stop.set()
            answers, waits = await attack
            assert all(r.status == "ok" for r in results), [(r.status, r.reason) for r in results]
            assert all(set(r.members) == {p.peer_id for p in peers} for r in results)
            expected = exact_mean(before, [1.0] * 3)
            for peer in peers:
                np.testing.assert_allclose(peer.tensors[0], expected, rtol=0, atol=1e-5)
            assert "accepted" not in answers and "malformed" in answers, answers
            for wait in waits:  # never a 500: a dropped follower is told so
                assert not isinstance(wait, Exception) or not is_status_500(wait), wait
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == [], [r.getMessage() for r in errors]


def test_membership_refusals_are_typed_and_duplicates_never_reach_a_group():
    me = PeerIdentity.generate().peer_id
    other = PeerIdentity.generate().peer_id
    member = GroupMember(me, "http://10.0.0.5:4000")
    check = membership_refusal
    assert check(member, sender=me, remote_host="10.0.0.5", taken=[]) is None
    assert "not the peer" in check(member, sender=other, remote_host="10.0.0.5", taken=[])
    assert "another member" in check(
        member, sender=me, remote_host="10.0.0.5", taken=["http://10.0.0.5:4000"]
    )
    assert "host" in check(member, sender=me, remote_host="10.0.0.6", taken=[])
    relayed = GroupMember(me, f"http://10.0.0.9:1/v2/relay/{me}")
    assert check(relayed, sender=me, remote_host="", taken=[]) is None
    stolen = GroupMember(me, f"http://10.0.0.9:1/v2/relay/{other}")
    assert "own peer id" in check(stolen, sender=me, remote_host="", taken=[])
    leader = GroupMember(other, "http://10.0.0.5:4000")
    kept, left_out = distinct_members([leader, member, GroupMember(other, None)])
    assert kept == [leader] and left_out == [me, other]
