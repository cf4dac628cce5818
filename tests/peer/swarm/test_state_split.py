"""Catch-up at scale (issue 24, item 4): a newcomer downloads one state from several donors at
once, each serving a part, gets it exactly, and falls back to fewer donors when one fails."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import pytest
import torch

from dht.tools.faults import Faults
from peer.swarm.state_download import download_state, layout_of
from peer.swarm.state_serve import part_ranges
from peer.swarm.state_sync import StateSnapshot, default_digest
from peer.swarm.state_sync_config import StateSyncConfig
from tests.peer.swarm.test_state_sync import CONFIG, peer, serve, trained_state

pytestmark = pytest.mark.timeout(60)


def state_with_a_large_tensor() -> dict[str, torch.Tensor]:
    state = trained_state(0)
    state["model.embedding"] = torch.randn(300_000)  # most of the bytes: shared by the donors
    return state


def wire_bytes(state: dict[str, torch.Tensor], bf16: bool) -> int:
    return sum(
        t.numel() * (2 if bf16 and t.dtype == torch.float32 else t.element_size())
        for t in state.values()
    )


def test_parts_tile_the_state_exactly():
    rng = random.Random(0)
    for _ in range(200):
        item_sizes = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 6))]
        sizes = [(item * rng.randint(0, 50), item) for item in item_sizes]
        count = rng.randint(1, 16)
        covered = [[] for _ in sizes]
        for index in range(count):
            for tensor, start, end in part_ranges(sizes, index, count):
                assert start % sizes[tensor][1] == 0 and end % sizes[tensor][1] == 0
                covered[tensor].append((start, end))
        for (num_bytes, _), ranges in zip(sizes, covered, strict=True):
            ranges.sort()
            position = 0
            for start, end in ranges:  # disjoint, in order, no gap
                assert start == position and end > start
                position = end
            assert position == num_bytes


@pytest.mark.parametrize("compression", ["none", "bf16"])
async def test_a_newcomer_downloads_parts_from_three_donors(compression):
    config = StateSyncConfig(
        chunk_bytes=64 * 1024, backoff_s=0.05, announce_interval_s=0.2, compression=compression
    )
    state = state_with_a_large_tensor()
    snapshot = StateSnapshot.capture(4, state, {"epoch": 4})
    async with AsyncExitStack() as stack:
        donors = []
        for _ in range(3):
            initial = [donors[0][0].address] if donors else []
            _, node, server = await stack.enter_async_context(peer(initial, config=config))
            await serve(server, snapshot)
            donors.append((node, server))
        transport, node, _ = await stack.enter_async_context(
            peer([donors[0][0].address], config=config)
        )
        got = await download_state(
            transport, node, "run", min_epoch=4, expected=layout_of(state), config=config
        )
    bf16 = compression == "bf16"
    assert default_digest(got, bf16) == default_digest(snapshot, bf16)  # the exact state
    if not bf16:
        assert all(torch.equal(got.tensors[k], v) for k, v in state.items())
    served = [server.limits.bytes_served for _, server in donors]
    # each donor served about a third of the bytes, together all of them, once
    assert sum(served) == wire_bytes(state, bf16)
    assert all(0.25 * sum(served) < part < 0.42 * sum(served) for part in served), served


async def test_a_donor_that_fails_leaves_its_part_to_the_others():
    state = state_with_a_large_tensor()
    snapshot = StateSnapshot.capture(4, state)
    faults = Faults(cut_streams_after_bytes=50_000)
    async with AsyncExitStack() as stack:
        donors = []
        for _ in range(3):
            initial = [donors[0][0].address] if donors else []
            _, node, server = await stack.enter_async_context(peer(initial))
            await serve(server, snapshot)
            donors.append((node, server))
        faults.cut_streams_to = {donors[1][0].address}
        transport, node, _ = await stack.enter_async_context(peer([donors[0][0].address], faults))
        got = await download_state(
            transport, node, "run", min_epoch=4, expected=layout_of(state), config=CONFIG
        )
    assert all(torch.equal(got.tensors[k], v) for k, v in state.items())
    served = [server.limits.bytes_served for _, server in donors]
    # the two others served the whole state between them (the cut one some bytes in vain)
    assert served[0] + served[2] >= wire_bytes(state, False), served


async def test_a_donor_serving_other_bytes_under_the_agreed_digest_is_caught_as_a_whole(caplog):
    state = state_with_a_large_tensor()
    honest = StateSnapshot.capture(4, state)
    poisoned = dict(state, **{"model.embedding": state["model.embedding"] + 1.0})
    liar_snapshot = StateSnapshot.capture(4, poisoned)
    digests = (default_digest(honest, False), default_digest(honest, True))
    async with AsyncExitStack() as stack:
        _, first, first_server = await stack.enter_async_context(peer([]))
        await serve(first_server, honest)
        _, _, second = await stack.enter_async_context(peer([first.address]))
        await serve(second, honest)
        _, _, liar = await stack.enter_async_context(peer([first.address]))
        liar.digest_fn = lambda snapshot, bf16: digests[bf16]  # announces the honest digest
        await serve(liar, liar_snapshot)
        transport, node, _ = await stack.enter_async_context(peer([first.address]))
        got = await download_state(
            transport, node, "run", min_epoch=4, expected=layout_of(state), config=CONFIG
        )
    # the parts together did not have the agreed digest: refused whole, then one donor at a
    # time until an honest one's state checks out
    assert any("from 3 donors failed" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(got.tensors[k], v) for k, v in state.items())
