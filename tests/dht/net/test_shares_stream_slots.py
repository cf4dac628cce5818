"""A node's stream slots: a fixed share per peer, a fair share per address under contention.

The holders are real tasks: a newcomer address's stream cancels the oldest stream of the
address holding the most, which gives its slot back as it unwinds.
"""

from __future__ import annotations

import asyncio

import pytest

from dht.net.limits import OverBudget, StreamSlots


async def _hold(slots: StreamSlots, peer: str, host: str, started: list, release: asyncio.Event):
    with slots.hold(peer, host):
        started.append((peer, host))
        await release.wait()


async def test_a_newcomer_address_cancels_a_stream_of_an_address_over_its_share():
    slots = StreamSlots(max_per_peer=8, max_per_address=4, max_total=8)
    release = asyncio.Event()
    started: list = []
    held = [
        asyncio.create_task(_hold(slots, f"{host}-{i}", host, started, release))
        for host in ("10.0.0.2", "10.0.0.3")
        for i in range(4)
    ]
    await asyncio.sleep(0)
    assert slots.num_open == 8
    with pytest.raises(OverBudget, match="its most"), slots.hold("x", "10.0.0.2"):
        pass
    newcomer = asyncio.create_task(_hold(slots, "honest", "10.0.0.1", started, release))
    await asyncio.sleep(0.01)
    assert ("honest", "10.0.0.1") in started
    cancelled = [task for task in held if task.cancelled()]
    assert cancelled == [held[0]]  # the oldest stream of the first address holding the most
    assert slots.num_open == 8  # the capacity held, the cancelled stream's slot given back
    release.set()
    await asyncio.gather(newcomer, *held, return_exceptions=True)
    assert slots.num_open == 0


async def test_a_peer_keeps_its_fixed_share_and_an_unknown_address_counts_per_peer():
    slots = StreamSlots(max_per_peer=2, max_per_address=8, max_total=8)
    with slots.hold("p", ""), slots.hold("p", ""):
        with pytest.raises(OverBudget, match="this peer"), slots.hold("p", "10.0.0.9"):
            pass
        with slots.hold("q", ""):  # another peer without a known address: its own key
            assert slots.num_open == 3
    assert slots.num_open == 0
