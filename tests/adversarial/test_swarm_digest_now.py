"""Answers to ``state.digest_now`` are a donor's claims: lying ones delay a download by the
downloader's bounded rereads and change nothing it accepts.

Real transports, DHT nodes and state servers on loopback. Two honest donors announce epoch 1 and
are at epoch 4 off their digest grid; three attackers serve and announce the same states, epochs
1 and 4 (so they are donors like any other and are asked), but answer the request with an epoch
far ahead (two of them: enough to set the epoch waited for) or with garbage. Unasked, the honest
donors' newest digest is epoch 1, which all five announce: they are tried first and serve it.
"""

from __future__ import annotations

import dataclasses
from contextlib import AsyncExitStack

import pytest
import torch

from peer.records.schema import MAX_COUNT
from peer.swarm.state_download import download_state, layout_of
from peer.swarm.state_fresh import NUM_ASKED
from peer.swarm.state_sync import DIGEST_NOW_NAME, StateSnapshot
from tests.peer.swarm.test_digest_schedule import STRIDED, _off_the_grid
from tests.peer.swarm.test_state_sync import peer, trained_state

pytestmark = pytest.mark.timeout(60)


def _lying(answer):
    async def on_digest_now(ctx, request):
        return answer

    return on_digest_now


async def test_donors_that_lie_about_their_newest_epoch_only_delay_the_download(monkeypatch):
    monkeypatch.setattr("peer.swarm.state_sync.LINGER_S", 60.0)
    state = trained_state(6)
    config = dataclasses.replace(STRIDED, max_split_donors=1)
    async with AsyncExitStack() as stack:
        _, first_node, first = await stack.enter_async_context(peer([], config=config))
        _, _, second = await stack.enter_async_context(peer([first_node.address], config=config))
        answers = [{"epoch": MAX_COUNT}, {"epoch": MAX_COUNT}, {"epoch": ["x"] * 1000}]
        liars = []
        for answer in answers:
            transport, _, liar = await stack.enter_async_context(
                peer([first_node.address], config=config)
            )
            transport.add_rpc_handler(DIGEST_NOW_NAME, _lying(answer))
            liars.append(liar)
        assert 2 + len(liars) <= NUM_ASKED  # every donor is asked
        for donor in (first, second, *liars):
            donor.update(StateSnapshot.capture(1, state))
            await donor.settle()
        for donor in (first, second):
            _off_the_grid(donor)
        for epoch in (2, 3, 4):
            for donor in (first, second, *liars):
                donor.update(StateSnapshot.capture(epoch, state))
        for liar in liars:
            await liar.settle()
            await liar.announce()
        transport, node, _ = await stack.enter_async_context(peer([first_node.address]))
        got = await download_state(
            transport, node, "run", min_epoch=1, expected=layout_of(state), config=config
        )
        # the honest donors were asked too: their newest is agreed and tried first once the
        # rereads for the claimed epoch end
        assert got.epoch == 4
        assert [d.epoch for d in first.digests] == [d.epoch for d in second.digests] == [1, 4]
    assert all(torch.equal(got.tensors[k], v) for k, v in state.items())
