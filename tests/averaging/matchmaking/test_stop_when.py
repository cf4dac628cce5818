"""A search for a group that the caller ends early (``step(stop_when=...)``): the peer stops
looking as soon as it learns nobody will come, instead of waiting out the matchmaking time
(issue 24: a newcomer entering an epoch the swarm had just left sat out 10 s per round)."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.averaging.conftest import fast_config


async def test_a_search_ends_with_the_callers_reason_once_it_gives_one(make_swarm):
    values = np.arange(10, dtype=np.float32)
    config = fast_config(matchmaking_time_s=30.0)
    (peer,) = await make_swarm([[values.copy()]], config=config)
    asked = []

    def stop_when() -> str | None:
        asked.append(True)
        return "the swarm moved on to epoch 8" if len(asked) >= 3 else None

    # the guard is far below the matchmaking time: only stop_when can end the search in time
    result = await asyncio.wait_for(peer.averager.step(epoch=7, stop_when=stop_when), 20)
    assert result.status == "alone" and result.reason == "the swarm moved on to epoch 8"
    assert len(asked) == 3  # asked between reads until it said stop, not after
    np.testing.assert_array_equal(peer.tensors[0], values)


async def test_peers_that_are_never_told_to_stop_average_as_before(make_swarm):
    vectors = [np.full(10, float(i), np.float32) for i in range(2)]
    peers = await make_swarm([[v.copy()] for v in vectors], config=fast_config())
    results = await asyncio.gather(
        *(p.averager.step(epoch=0, expected_peers=2, stop_when=lambda: None) for p in peers)
    )
    assert [r.status for r in results] == ["ok", "ok"]
    for peer in peers:
        np.testing.assert_allclose(peer.tensors[0], np.full(10, 0.5, np.float32))
