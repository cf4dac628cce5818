"""A member whose streams open after its reducers dropped it (no CPU for a second, on a crowded
host) gets their averages all the same, so that its replica ends equal to the group's: real
averagers on loopback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from averaging.averager import DecentralizedAverager
from averaging.config import AveragerConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from dht.tools.faults import Faults, FaultyTransport
from tests.averaging.conftest import Peer, exact_mean, make_group, peer_values

pytestmark = pytest.mark.timeout(90)

CONNECT_S = 2.0  # the reducers' wait for a sender's stream (fixed: sender_timeout_s)
LATE_S = 3.0  # when the late member begins its round: past CONNECT_S
# The slow member's every stream send waits this long: it connects in time, and each of its
# chunks (two sends) comes within the chunk wait, so that every round is still going, waiting
# on its chunks, when the late member's streams open.
SLOW_SEND_S = 0.4
CHUNK_NUMEL = 4096
SIZE = 4 * 8 * CHUNK_NUMEL  # eight chunks a part: the others' rounds last about 6 s


def _config() -> AveragerConfig:
    return AveragerConfig(
        adaptive_deadlines=False,
        sender_timeout_s=CONNECT_S,
        group_wait_s=10.0,  # every stream to the late member's part waits for it
        reducer_timeout_s=20.0,
    )


@pytest.fixture
async def slow_peer():
    """A member whose stream sends are slow (its senders hold every round up)."""
    transport = HttpTransport(PeerIdentity.generate(), TransportConfig())
    faulty = FaultyTransport(transport, Faults(delay_s=SLOW_SEND_S))
    tensors = [peer_values(4, 3, SIZE)]
    averager = DecentralizedAverager(
        tensors, transport=faulty, dht=None, prefix="t", config=_config()
    )
    await transport.start()
    try:
        yield Peer(transport, averager, tensors)
    finally:
        await averager.close()
        await transport.close()


async def test_a_member_that_connects_late_gets_the_averages_and_ends_equal(make_peers, slow_peer):
    vectors = [peer_values(4, rank, SIZE) for rank in range(4)]
    peers = [*await make_peers([[v.copy()] for v in vectors[:3]], config=_config()), slow_peer]
    late = peers[2]
    group = make_group(peers, chunk_numel=CHUNK_NUMEL)

    async def step(peer):
        if peer is late:
            await asyncio.sleep(LATE_S)
        return await peer.averager.step_in_group(group)

    results = await asyncio.wait_for(asyncio.gather(*(step(p) for p in peers)), 60)

    # every replica is the same, bit for bit
    for peer in peers:
        np.testing.assert_array_equal(peer.tensors[0], late.tensors[0])
    # the parts the others reduce average the three others; the late member's own part, which
    # the others' streams waited for (group_wait_s), averages all four
    on_time = [vectors[i] for i in (0, 1, 3)]
    expected = {True: exact_mean(vectors, [1.0] * 4), False: exact_mean(on_time, [1.0] * 3)}
    for member, parts in zip(group.members, group.stream_parts(SIZE), strict=True):
        mean = expected[member.peer_id == late.peer_id]
        for part in parts:
            np.testing.assert_allclose(
                late.tensors[0][part.start : part.end],
                mean[part.start : part.end],
                rtol=1e-5,
                atol=1e-6,
            )
    # each says what happened: the others dropped it; it was late to their three parts
    by_peer = dict(zip((p.peer_id for p in peers), results, strict=True))
    for peer in (p for p in peers if p is not late):
        result = by_peer[peer.peer_id]
        assert result.status == "partial" and result.dropped_peers == (late.peer_id,), result
        assert "no connection within connect_s" in result.reason
    mine = by_peer[late.peer_id]
    assert mine.status == "partial" and mine.dropped_peers == (), mine
    assert mine.reason.count("its part came back without our values") == 3, mine.reason
    assert mine.averaged_fraction == 1.0
