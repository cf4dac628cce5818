"""Several streams per (sender, reducer) pair: slices of whole chunks, each on its own TCP
connection, averaged exactly; the number is the leader's, chosen from its measured RTT."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from averaging.allreduce.protocol import PartHeader, pack_chunk_header
from averaging.allreduce.streams import StreamChooser
from averaging.config import AveragerConfig
from averaging.errors import ConfigError, ProtocolViolation
from averaging.matchmaking.group import GroupInfo, GroupMember, check_offered
from averaging.matchmaking.partition import Part, split_streams
from tests.averaging.conftest import exact_mean, fast_config, make_group
from tests.averaging.test_bad_peers import client_transport, nan_chunk, send_bad_stream

pytestmark = pytest.mark.timeout(60)
PEER = "ab" * 32


@given(
    numel=st.integers(0, 50_000),
    chunk_numel=st.sampled_from([1024, 2048, 5120]),
    num_streams=st.integers(1, 8),
)
def test_slices_are_whole_chunks_that_cover_the_part_in_order(numel, chunk_numel, num_streams):
    part = Part(3, 1000, 1000 + numel, chunk_numel)
    slices = split_streams(part, num_streams)
    assert len(slices) == max(1, min(num_streams, part.num_chunks))
    assert [s.stream for s in slices] == list(range(len(slices)))
    assert slices[0].start == part.start and slices[-1].end == part.end
    for before, after in itertools.pairwise(slices):
        assert before.end == after.start
    for piece in slices:
        assert (piece.index, piece.chunk_numel) == (3, chunk_numel)
        assert (piece.start - part.start) % chunk_numel == 0  # the part's own chunk boundaries
    sizes = [s.num_chunks for s in slices]
    assert max(sizes) - min(sizes) <= 1


def chooser(rtt_s: float | None, **changes) -> StreamChooser:
    return StreamChooser(AveragerConfig(**changes), lambda: rtt_s)


def test_a_short_or_unmeasured_link_gets_one_stream_and_nothing_is_tried():
    for rtt_s in (None, float("nan"), 0.0, 0.0002, 0.0199):
        streams = chooser(rtt_s)
        assert [streams.choose() for _ in range(20)] == [1] * 20
    assert chooser(2.0, streams_per_pair=2).choose() == 2  # fixed: always that


def test_a_long_link_tries_each_number_from_the_rtts_guess_then_keeps_the_fastest():
    streams = chooser(0.050)  # 50 ms: the guess is one stream per 20 ms, 3
    assert streams.guess() == 3
    goodput = {1: 10e6, 2: 30e6, 3: 25e6, 4: 20e6}  # bytes/s each number achieves
    tried = []
    for _ in range(4):
        tried.append(streams.choose())
        streams.observe(tried[-1], int(goodput[tried[-1]]), 1.0)
    assert tried == [3, 2, 4, 1]  # the guess, then outward from it
    later = [streams.choose() for _ in range(15)]
    # the fastest, and every 8th group led a neighbour of it (the one measured least)
    assert later.count(2) == 13 and set(later) - {2} <= {1, 3}
    assert streams.goodput_bytes_per_s() == goodput


def test_the_choice_follows_a_link_that_changes():
    streams = chooser(0.150, max_streams_per_pair=2)
    for n, goodput in ((2, 30e6), (1, 10e6)):
        assert streams.choose() == n
        streams.observe(n, int(goodput), 1.0)
    for _ in range(40):  # the link's loss goes away: one stream now moves more
        n = streams.choose()
        streams.observe(n, int(40e6 if n == 1 else 30e6), 1.0)
    assert streams.choose() == 1


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"streams_per_pair": 9, "max_streams_per_pair": 8}, "streams_per_pair"),
        ({"streams_per_pair": 5}, "streams_per_pair"),
        ({"max_streams_per_pair": 0}, "max_streams_per_pair"),
        ({"max_streams_per_pair": 9}, "max_streams_per_pair"),
        ({"rtt_per_stream_s": 0.0}, "rtt_per_stream_s"),
    ],
)
def test_bad_stream_settings_name_their_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        AveragerConfig(**changes)


def test_the_group_carries_its_number_of_streams_and_a_follower_bounds_it():
    me = GroupMember(PEER, "http://h:1", 1.0, 1.0)
    group = GroupInfo("g1", (me,), num_streams=3)
    assert GroupInfo.from_wire(group.to_wire()) == group
    old = {k: v for k, v in group.to_wire().items() if k != "streams"}
    assert GroupInfo.from_wire(old).num_streams == 1  # a leader that does not say: one
    for bad in (0, 9, True, 2.0, "2"):
        with pytest.raises(ProtocolViolation, match="streams"):
            GroupInfo.from_wire({**group.to_wire(), "streams": bad})
    offered = {"me": me, "leader": (PEER, "http://h:1"), "max_size": 4, "numel": 10}
    common = {"aggregation": group.aggregation, "max_weight_ratio": group.max_weight_ratio}
    check_offered(group, **offered, **common, max_streams=3)
    with pytest.raises(ProtocolViolation, match="3 streams"):
        check_offered(group, **offered, **common, max_streams=2)


def test_a_relayed_reducers_part_takes_one_stream():
    # each stream to a relayed peer holds one of the few slots its relay gives a caller's address
    relayed = GroupMember("b" * 64, "http://relay:1/v2/relay/" + "b" * 64, 1.0, 1.0)
    direct = GroupMember("c" * 64, "http://h:2", 1.0, 1.0)
    client = GroupMember("d" * 64, None, 1.0, 1.0)
    assert relayed.relayed and not direct.relayed and not client.relayed
    group = GroupInfo("g1", (relayed, direct, client), chunk_numel=1024, num_streams=4)
    slices = group.stream_parts(100_000)
    assert [len(s) for s in slices] == [1, 4, 0]
    assert slices[0] == [group.parts(100_000)[0]]


def test_the_part_header_names_its_stream():
    header = PartHeader("g", 1, 2.5, 100, "uint8", 1024, stream=2)
    assert PartHeader.from_wire(header.to_wire()) == header
    old = {k: v for k, v in header.to_wire().items() if k != "stream"}
    assert PartHeader.from_wire(old).stream == 0
    for bad in (-1, "1", True, None):
        with pytest.raises(ProtocolViolation, match="stream"):
            PartHeader.from_wire({**header.to_wire(), "stream": bad})


async def _open_connections(peer, at_least: int, timeout_s: float = 8.0) -> int:
    """The connections open at ``peer`` once there are ``at_least`` (or ``timeout_s`` later:
    a fixed 0.3-s look saw none under a loaded suite, before the senders had started)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        num_open = peer.transport.gate.num_open
        if num_open >= at_least or asyncio.get_running_loop().time() >= deadline:
            return num_open
        await asyncio.sleep(0.01)


async def test_several_streams_per_pair_average_exactly_over_as_many_connections(make_peers):
    num_peers, num_streams, size = 3, 3, 60_001  # several chunks per part, uneven slices
    rng = np.random.default_rng(5)
    vectors = [rng.standard_normal(size).astype(np.float32) for _ in range(num_peers)]
    weights = [0.5, 2.0, 3.25]
    # the late peer's senders connect after it starts, and the others' streams wait for its
    # group: a loaded host took over the fast 2 s for either
    config = fast_config(sender_timeout_s=10.0, reducer_timeout_s=20.0, group_wait_s=10.0)
    peers = await make_peers([[v.copy()] for v in vectors], config=config)
    members = sorted(
        (GroupMember(p.peer_id, p.address, 1.0, w) for p, w in zip(peers, weights, strict=True)),
        key=lambda m: m.peer_id,
    )
    group = GroupInfo(secrets.token_hex(8), tuple(members), chunk_numel=2048, num_streams=3)

    # the last peer starts late: the others' streams to it wait, open, for its group
    steps = [asyncio.create_task(p.averager.step_in_group(group)) for p in peers[:-1]]
    num_held = await _open_connections(peers[-1], at_least=(num_peers - 1) * num_streams)
    steps.append(asyncio.create_task(peers[-1].averager.step_in_group(group)))
    results = await asyncio.gather(*steps)

    # each of the two others opened its own connection for each of the streams
    assert num_held >= (num_peers - 1) * num_streams
    expected = exact_mean(vectors, weights)
    for peer, result in zip(peers, results, strict=True):
        assert result.status == "ok", result.reason
        assert result.num_streams == num_streams
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)
    # every value is identical across the group (each slice's reducer sent the same bytes)
    for peer in peers[1:]:
        np.testing.assert_array_equal(peer.tensors[0], peers[0].tensors[0])


async def test_the_leader_chooses_the_streams_from_its_measured_rtt(make_swarm):
    # loopback's RTT is tiny: a per-stream RTT smaller still makes the choice the maximum
    rng = np.random.default_rng(6)
    vectors = [rng.standard_normal(30_000).astype(np.float32) for _ in range(2)]
    config = fast_config(
        target_group_size=2, rtt_per_stream_s=1e-7, max_streams_per_pair=4, chunk_numel=1024
    )
    peers = await make_swarm([[v.copy()] for v in vectors], config=config)
    results = await asyncio.gather(*(p.averager.step(weight=1.0) for p in peers))
    for peer, result in zip(peers, results, strict=True):
        assert result.status == "ok", result.reason
        assert result.num_streams == 4
        np.testing.assert_allclose(peer.tensors[0], exact_mean(vectors, [1, 1]), rtol=1e-5)


async def test_a_member_that_breaks_one_slice_is_out_of_every_slice(make_peers):
    # its slice 0 carries NaN; then it sends a well-formed slice 1: nothing of it may count
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(8192).astype(np.float32) for _ in range(2)]
    honest = await make_peers([[v.copy()] for v in vectors], config=fast_config())
    async with client_transport() as bad:
        group = make_group([*honest, bad], [1.0, 2.0, 5.0], chunk_numel=1024)
        group = dataclasses.replace(group, num_streams=2)

        async def misbehave() -> list[str]:
            answers = []
            for stream in (0, 1):  # the broken slice first, then the good one
                for parts in group.stream_parts(8192):
                    part = next((p for p in parts if p.stream == stream), None)
                    if part is None:
                        continue
                    header = PartHeader(
                        group.group_id, part.index, 5.0, part.numel, group.compression,
                        part.chunk_numel, stream=stream,
                    ).to_wire()  # fmt: skip
                    frames = (
                        nan_chunk(part.chunk_size(0))
                        if stream == 0
                        else [
                            frame
                            for chunk in range(part.num_chunks)
                            for frame in (
                                pack_chunk_header(chunk, 4 * part.chunk_size(chunk)),
                                np.ones(part.chunk_size(chunk), np.float32).tobytes(),
                            )
                        ]
                    )
                    answers.append(await send_bad_stream(bad, group, part, header, frames))
            return answers

        *results, answers = await asyncio.gather(
            *(p.averager.step_in_group(group) for p in honest), misbehave()
        )
    assert answers and all(a.startswith("refused") for a in answers), answers
    for peer, result in zip(honest, results, strict=True):
        assert bad.peer_id in result.dropped_peers
        np.testing.assert_allclose(
            peer.tensors[0], exact_mean(vectors, [1.0, 2.0]), rtol=1e-5, atol=1e-6
        )
