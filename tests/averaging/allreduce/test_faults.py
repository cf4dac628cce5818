"""A peer that dies (SIGKILL) or stalls (SIGSTOP) in the middle of a round.

Two survivors run in this process; the victim runs in a subprocess that kills or stops itself
once some of its chunks were delivered (or received). The survivors must finish within the round's
bounds, report the victim as dropped and the round as partial, and hold in every chunk of the
parts they reduce either the weighted mean of all three (a chunk the victim had delivered) or the
weighted mean of the two survivors (a chunk it had not); in the victim's part, either the average
it sent back before failing or their own values.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from tests.averaging.conftest import exact_mean, fast_config, make_group, peer_values

pytestmark = pytest.mark.timeout(90)
SEED, SIZE, CHUNK = 5, 2_000_000, 16 * 1024  # parts of 2.7 MB: more than socket buffers hold
WEIGHTS = [1.0, 2.0, 4.0]  # survivor a, survivor b, victim
TIMEOUTS = {"sender_timeout_s": 1.5, "reducer_timeout_s": 3.0, "allreduce_timeout_s": 20.0}


def chunks_of(group, part_index: int):
    part = group.parts(SIZE)[part_index]
    for chunk in range(part.num_chunks):
        lo, hi = part.chunk_bounds(chunk)
        yield part.start + lo, part.start + hi


def matches(values: np.ndarray, reference: np.ndarray) -> bool:
    return np.allclose(values, reference, rtol=1e-5, atol=1e-6)


async def run_round_with_victim(make_peers, spawn_peer, tmp_path, fault: dict):
    vectors = [peer_values(SEED, rank, SIZE) for rank in range(3)]
    config = fast_config(**TIMEOUTS)
    survivors = await make_peers([[vectors[0].copy()], [vectors[1].copy()]], config=config)
    victim = await spawn_peer(
        {
            "seed": SEED,
            "rank": 2,
            "size": SIZE,
            "config": dataclasses.asdict(config),
            "out": str(tmp_path / "victim.npy"),
            "fault": fault,
        }
    )
    group = make_group([*survivors, victim], WEIGHTS, chunk_numel=CHUNK)
    steps = asyncio.gather(*(p.averager.step_in_group(group) for p in survivors))
    victim.run_group(group)
    results = await asyncio.wait_for(steps, 30)
    return vectors, survivors, victim, group, results


def check_survivors(vectors, survivors, victim, group, results) -> dict[str, int]:
    """Check every chunk the survivors hold; count the chunks of each kind."""
    mean_all = exact_mean(vectors, WEIGHTS)
    mean_survivors = exact_mean(vectors[:2], WEIGHTS[:2])
    victim_index = group.index_of(victim.peer_id)
    for result in results:
        assert result.status == "partial", result
        assert victim.peer_id in result.dropped_peers, result
        assert 0 < result.averaged_fraction <= 1, result  # what was lost: each test's own
    counts = {"all": 0, "survivors": 0, "victim part averaged": 0, "victim part kept": 0}
    for index in range(len(group.members)):
        for lo, hi in chunks_of(group, index):
            values = survivors[0].tensors[0][lo:hi]
            if index == victim_index:
                for peer, own in zip(survivors, vectors, strict=False):
                    kept = np.array_equal(peer.tensors[0][lo:hi], own[lo:hi])
                    assert kept or matches(peer.tensors[0][lo:hi], mean_all[lo:hi])
                    counts["victim part kept" if kept else "victim part averaged"] += 1
            elif matches(values, mean_all[lo:hi]):
                counts["all"] += 1
            else:
                assert matches(values, mean_survivors[lo:hi])
                counts["survivors"] += 1
            if index != victim_index:  # both survivors hold the same average
                np.testing.assert_array_equal(survivors[1].tensors[0][lo:hi], values)
    return counts


async def test_peer_killed_while_sending(make_peers, spawn_peer, tmp_path):
    outcome = await run_round_with_victim(
        make_peers, spawn_peer, tmp_path, {"action": "kill", "on": "reply", "after": 1}
    )
    counts = check_survivors(*outcome)
    assert counts["all"] >= 1, counts  # it delivered a chunk before it died
    # Its own part may be averaged whole or not: its reducer can answer every chunk before its
    # sender reads its first reply (on a loaded host it did). Every chunk is checked all the
    # same: the mean of all three, of the survivors, or kept.
    assert outcome[2].process.wait(10) < 0  # it really died of the signal


async def test_peer_killed_while_reducing(make_peers, spawn_peer, tmp_path):
    outcome = await run_round_with_victim(
        make_peers, spawn_peer, tmp_path, {"action": "kill", "on": "recv", "after": 2}
    )
    counts = check_survivors(*outcome)
    # It had received two chunks when it died: most of its part stayed with the survivors.
    assert counts["victim part kept"] >= 2 * (len(list(chunks_of(outcome[3], 0))) - 1), counts
    assert outcome[2].process.wait(10) < 0


async def test_peer_that_stalls_is_dropped(make_peers, spawn_peer, tmp_path):
    outcome = await run_round_with_victim(
        make_peers, spawn_peer, tmp_path, {"action": "stop", "on": "send", "after": 3}
    )
    counts = check_survivors(*outcome)
    assert counts["survivors"] >= 1 and counts["victim part kept"] >= 1, counts
    for result in outcome[-1]:
        # dropped as a sender that went silent (before it connected to this reducer, or after)
        assert "sender_timeout_s" in result.reason or "connect_s" in result.reason
        assert "stalled" in result.reason or "in time" in result.reason  # and as a reducer
    assert outcome[2].process.poll() is None  # stopped, not dead (the fixture kills it)
