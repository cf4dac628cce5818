"""A donor digests a deterministic subset of its epochs when hashing is costly next to an epoch:
powers of two that nest across peers, every jump, the newest it lingers at, and what it serves."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import AsyncExitStack

import pytest
import torch

from dht.errors import ConfigError
from peer.swarm.digest_schedule import (
    DIGEST_CPU_BUDGET,
    MAX_DIGEST_GAP_S,
    MAX_STRIDE,
    DigestSchedule,
    choose_stride,
)
from peer.swarm.state_download import download_state, layout_of
from peer.swarm.state_sync import DIGEST_NOW_NAME, StateSnapshot, default_digest
from tests.peer.swarm.test_state_sync import CONFIG, peer, trained_state

# the schedule's largest stride (StateSyncConfig's default), and every epoch
STRIDED = dataclasses.replace(CONFIG, max_digest_stride=64)
EVERY_EPOCH = dataclasses.replace(CONFIG, max_digest_stride=1)

pytestmark = pytest.mark.timeout(60)


def test_the_stride_is_the_smallest_power_of_two_within_the_budget():
    # 10 ms of hashing per 90 ms epoch: 1% needs 1 s of epochs, more than a 1-s gap allows
    assert choose_stride(cost_s=0.010, epoch_s=0.090, max_gap_s=1.0) == 8
    assert choose_stride(cost_s=0.010, epoch_s=0.090) == 16
    assert choose_stride(cost_s=0.0001, epoch_s=0.090) == 1  # cheap: every epoch
    assert choose_stride(cost_s=1.0, epoch_s=5.0) == 1  # one epoch outlasts the gap
    assert choose_stride(cost_s=1.0, epoch_s=1e-6) == MAX_STRIDE
    assert choose_stride(cost_s=0.0, epoch_s=0.1) == choose_stride(cost_s=1, epoch_s=0) == 1
    for stride in (2, 4, 8):  # within the budget, and the next smaller one was not
        cost_s = DIGEST_CPU_BUDGET * stride * 0.05
        assert choose_stride(cost_s=cost_s, epoch_s=0.05) == stride
        assert choose_stride(cost_s=cost_s * 1.01, epoch_s=0.05) == 2 * stride
    assert MAX_DIGEST_GAP_S == 4.0


def test_a_longer_gap_lets_a_schedule_stride_further():
    # 20 ms of hashing per 230-ms epoch (an 8-MB state on a slow host): the 1% budget needs a
    # stride of 16; 1 s of epochs allows 4 (0.92 s between digests), 4 s allows 16
    one, four = DigestSchedule(max_gap_s=1.0), DigestSchedule(max_gap_s=4.0)
    _digested(one, range(1, 40), epoch_s=0.23, cost_s=0.02)
    _digested(four, range(1, 40), epoch_s=0.23, cost_s=0.02)
    assert (one.stride, four.stride) == (4, 16)
    capped = DigestSchedule(max_stride=8, max_gap_s=4.0)
    _digested(capped, range(1, 40), epoch_s=0.23, cost_s=0.02)
    assert capped.stride == 8


def test_the_config_refuses_a_stride_or_gap_it_cannot_keep():
    for bad in (0, 3, 2 * MAX_STRIDE):
        with pytest.raises(ConfigError, match=f"max_digest_stride must be a power of two.*{bad}"):
            dataclasses.replace(CONFIG, max_digest_stride=bad)
    with pytest.raises(ConfigError, match="max_digest_gap_s must be positive"):
        dataclasses.replace(CONFIG, max_digest_gap_s=0.0)


def _digested(schedule: DigestSchedule, epochs, epoch_s: float, cost_s: float) -> set[int]:
    out, now = set(), 0.0
    for epoch in epochs:
        if schedule.wants(epoch, now):
            out.add(epoch)
            schedule.measured(cost_s)
        now += epoch_s
    return out


def test_peers_of_different_strides_share_the_coarser_grid():
    # a 1-s gap holds both short of the largest stride (with the default 4 s both reach 64)
    fast, slow = DigestSchedule(max_gap_s=1.0), DigestSchedule(max_gap_s=1.0)
    epochs = range(10, 400)
    mine = _digested(fast, epochs, epoch_s=0.03, cost_s=0.02)
    theirs = _digested(slow, epochs, epoch_s=0.06, cost_s=0.02)
    assert fast.stride == 32 and slow.stride == 16
    grid = {e for e in epochs if e % 32 == 0 and e >= 64}  # once both strides settled
    assert grid and grid <= mine & theirs
    assert 10 in mine and 10 in theirs  # the first snapshot, digested whatever the stride


def test_a_snapshot_that_does_not_follow_is_always_digested():
    schedule = DigestSchedule()
    _digested(schedule, range(1, 100), epoch_s=0.01, cost_s=0.05)
    assert schedule.stride > 1
    assert schedule.wants(200, 10.0)  # a download or a jump ahead
    assert schedule.wants(200, 10.1)  # a re-sync: the same epoch again
    assert not schedule.wants(201, 10.11)


def _costly(snapshot: StateSnapshot, bf16: bool) -> str:
    """The real digest, after 30 ms of CPU (a state much larger than the test's)."""
    until = time.thread_time() + 0.03
    while time.thread_time() < until:
        pass
    return default_digest(snapshot, bf16)


async def test_a_donor_digests_its_grid_and_the_newest_it_lingers_at():
    state = trained_state(0)
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([], config=STRIDED))
        at_epoch, first_known_at = [0], []  # the loop's epoch when the first cost was known
        measured = donor._schedule.measured

        def measured_at(cost_s: float) -> None:
            if not first_known_at:
                first_known_at.append(at_epoch[0])
            measured(cost_s)

        donor._schedule.measured = measured_at
        donor.digest_fn = _costly
        for epoch in range(1, 41):  # 60 ms of hashing per 10 ms epoch: a stride of 32 or more
            at_epoch[0] = epoch
            donor.update(StateSnapshot.capture(epoch, state))
            await asyncio.sleep(0.01)
        assert donor._schedule.stride >= 8
        for _ in range(200):  # lingered at 40: digested and announced
            if donor.served is not None and donor.served.epoch == 40:
                break
            await asyncio.sleep(0.1)
        digested = [d.epoch for d in donor.digests]
        assert digested[0] == 1 and digested[-1] == 40, digested
        # once the first digest's cost is known, only epochs some stride >= 2 picks, up to the
        # newest (before it, the few that queued up while the first one was hashed: more of them
        # on a loaded host, where the hashing took longer)
        known = first_known_at[0]
        assert all(e % 2 == 0 for e in digested[1:-1] if e > known), (digested, known)
        assert len([e for e in digested if e > 10]) < 30 // 2
        # a newcomer gets the newest state, checked against its announced digest
        transport, node, _ = await stack.enter_async_context(peer([donor_node.address]))
        got = await download_state(
            transport, node, "run", min_epoch=40, expected=layout_of(state), config=CONFIG
        )
    assert got.epoch == 40
    assert all(torch.equal(got.tensors[k], v) for k, v in state.items())


async def test_a_newcomer_asking_for_an_epoch_the_schedule_skipped_gets_it_digested():
    state = trained_state(1)
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([], config=STRIDED))
        donor.digest_fn = _costly
        donor.update(StateSnapshot.capture(1, state))
        await donor.settle()
        _off_the_grid(donor)  # nothing after the first is due
        for epoch in (2, 3):
            donor.update(StateSnapshot.capture(epoch, state))
        await asyncio.sleep(0.05)
        assert [d.epoch for d in donor.digests] == [1]
        transport, node, _ = await stack.enter_async_context(peer([donor_node.address]))
        got = await download_state(  # sooner than the linger: the request has it digested
            transport, node, "run", min_epoch=3, expected=layout_of(state), config=CONFIG
        )
    assert got.epoch == 3


def _off_the_grid(donor) -> None:
    """From now on ``donor``'s schedule digests no epoch that follows the one before."""
    donor._schedule.stride = 1 << 20
    donor._schedule.measured = lambda cost_s: None
    donor._schedule._restride = lambda: None


async def test_a_newcomer_gets_the_donors_newest_state_not_the_last_one_their_schedule_chose(
    monkeypatch,
):
    # two donors announce epoch 1, then step to 4 off their grid: the newest agreed state is
    # 1, long before either lingers at 4 (60 s here). A download of any epoch asks them to
    # digest now and waits for epoch 4 to be agreed (it arrived 3 epochs behind before: a
    # newcomer to a swarm of fast epochs then spent its first rounds alone).
    monkeypatch.setattr("peer.swarm.state_sync.LINGER_S", 60.0)
    state = trained_state(4)
    async with AsyncExitStack() as stack:
        _, first_node, first = await stack.enter_async_context(peer([], config=STRIDED))
        _, _, second = await stack.enter_async_context(peer([first_node.address], config=STRIDED))
        for donor in (first, second):
            donor.update(StateSnapshot.capture(1, state))
            await donor.settle()
            _off_the_grid(donor)
        for epoch in (2, 3, 4):
            for donor in (first, second):
                donor.update(StateSnapshot.capture(epoch, state))
        await asyncio.sleep(0.05)
        assert [d.epoch for d in first.digests] == [d.epoch for d in second.digests] == [1]
        transport, node, _ = await stack.enter_async_context(peer([first_node.address]))
        got = await download_state(
            transport, node, "run", min_epoch=1, expected=layout_of(state), config=STRIDED
        )
        assert got.epoch == 4
        assert [d.epoch for d in first.digests] == [d.epoch for d in second.digests] == [1, 4]
        # asked to digest now, each digests every epoch for a while (a download's rereads)
        first.update(StateSnapshot.capture(5, state))
        for _ in range(100):
            if first.digests[-1].epoch == 5:
                break
            await asyncio.sleep(0.05)
        assert [d.epoch for d in first.digests] == [1, 4, 5]
    assert all(torch.equal(got.tensors[k], v) for k, v in state.items())


async def test_epochs_faster_than_the_announcement_gap_each_get_their_digest():
    # 20 epochs of 30 ms: more than the pending queue holds arrive within one announcement gap
    # (0.5 s); digested as they come, none is dropped for a newer one
    state = trained_state(2)
    async with AsyncExitStack() as stack:
        _, _, donor = await stack.enter_async_context(peer([], config=EVERY_EPOCH))
        for epoch in range(1, 21):
            donor.update(StateSnapshot.capture(epoch, state))
            await asyncio.sleep(0.03)
        await donor.settle()
        assert [d.epoch for d in donor.digests] == list(range(5, 21))  # the last MAX_DIGESTS


async def test_a_snapshot_handed_over_while_the_announcement_is_on_its_way_is_announced():
    # the store of an announcement outlasting an epoch (a loaded host, a slow DHT): the snapshot
    # queued meanwhile found the digest task still running and was left in its queue
    state = trained_state(3)
    async with AsyncExitStack() as stack:
        _, _, donor = await stack.enter_async_context(peer([], config=EVERY_EPOCH))
        announce, announcing = donor.announce, asyncio.Event()

        async def slow_announce() -> None:
            announcing.set()
            await asyncio.sleep(1.0)
            await announce()

        donor.announce = slow_announce
        donor.update(StateSnapshot.capture(1, state))
        await asyncio.wait_for(announcing.wait(), 10)
        donor.update(StateSnapshot.capture(2, state))
        for _ in range(100):
            if donor.served is not None and donor.served.epoch == 2:
                break
            await asyncio.sleep(0.05)
        assert [d.epoch for d in donor.digests] == [1, 2]
        assert donor.served.epoch == 2


async def test_a_stranger_asking_to_digest_now_costs_a_donor_one_digest_per_epoch(monkeypatch):
    # 50 requests at once, then 50 more, at one epoch: its state is hashed once (two digests);
    # what the requests can buy is the stride-1 hashing the schedule saves, not more
    monkeypatch.setattr("peer.swarm.state_sync.LINGER_S", 60.0)
    state = trained_state(5)
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([], config=STRIDED))
        calls = []

        def counted(snapshot: StateSnapshot, bf16: bool) -> str:
            calls.append(snapshot.epoch)
            return default_digest(snapshot, bf16)

        donor.digest_fn = counted
        donor.update(StateSnapshot.capture(1, state))
        await donor.settle()
        _off_the_grid(donor)
        donor.update(StateSnapshot.capture(2, state))
        transport, _, _ = await stack.enter_async_context(peer([donor_node.address]))
        for _ in range(2):
            answers = await asyncio.gather(
                *(
                    transport.call(donor_node.address, DIGEST_NOW_NAME, {"epoch": "x" * 100})
                    for _ in range(50)
                )
            )
            assert {a["epoch"] for a in answers} == {2}
            await donor.settle()
        assert calls == [1, 1, 2, 2]  # the exact and the bf16 digest of each epoch, once
        assert [d.epoch for d in donor.digests] == [1, 2]
