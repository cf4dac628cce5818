"""Parts and chunks (load balancing) and the group and header wire formats."""

from __future__ import annotations

import pytest

from averaging.allreduce.protocol import PartHeader, pack_chunk_header, unpack_chunk_header
from averaging.errors import BadChunkError, ProtocolViolation
from averaging.matchmaking.group import GroupInfo, GroupMember, check_offered, num_reducers
from averaging.matchmaking.partition import MIN_CHUNK_NUMEL, chunk_numel_of, make_parts, part_sizes

PEER = "ab" * 32


@pytest.mark.parametrize("total", [0, 1, 7, 1000, 10**7 + 3])
@pytest.mark.parametrize("bandwidths", [[1.0], [1, 1, 1], [1, 0, 3], [0.5, 2, 2, 7.25]])
def test_parts_cover_the_vector_in_proportion(total, bandwidths):
    sizes = part_sizes(total, bandwidths)
    assert sum(sizes) == total
    for size, bandwidth in zip(sizes, bandwidths, strict=True):
        assert abs(size - total * bandwidth / sum(bandwidths)) < 1
        assert bandwidth or size == 0  # a client-mode peer reduces nothing
    parts = make_parts(total, bandwidths, 4096)
    assert [p.start for p in parts[1:]] == [p.end for p in parts[:-1]]
    for part in parts:
        assert sum(part.chunk_size(c) for c in range(part.num_chunks)) == part.numel


def test_bad_bandwidths():
    with pytest.raises(ValueError):
        part_sizes(10, [0, 0])
    with pytest.raises(ValueError):
        part_sizes(10, [1, -1])


def test_small_parts_get_smaller_chunks():
    assert chunk_numel_of(10**7, 256 * 1024) == 256 * 1024
    assert chunk_numel_of(200_000, 256 * 1024) == 49 * 1024  # four chunks, whole blocks
    assert chunk_numel_of(1_000, 256 * 1024) == MIN_CHUNK_NUMEL


def test_group_roundtrips_and_refuses_malformed_groups():
    group = GroupInfo(
        "g1", (GroupMember(PEER, "http://h:1", 2.0, 3.0), GroupMember("cd" * 32, None))
    )
    assert GroupInfo.from_wire(group.to_wire()) == group
    bad_groups = [
        None,
        {**group.to_wire(), "members": []},
        {**group.to_wire(), "members": [group.members[0].to_wire()] * 2},
        {**group.to_wire(), "members": [{"peer": "x", "addr": None, "bw": 1, "w": 1}]},
        {**group.to_wire(), "members": [{"peer": PEER, "addr": "a", "bw": 1, "w": -1}]},
        {**group.to_wire(), "members": [{"peer": PEER, "addr": None, "bw": 1, "w": 1}]},
        {**group.to_wire(), "compression": "zip"},
        {**group.to_wire(), "chunk": 1000},
        {**group.to_wire(), "chunk": True},
    ]
    for raw in bad_groups:
        with pytest.raises(ProtocolViolation):
            GroupInfo.from_wire(raw)


def test_a_large_group_reduces_on_its_first_target_size_members_and_followers_check_it():
    """The delegates of many rows: only ``num_reducers`` members (in member order, those with
    an address) reduce; the others only send and receive (issue 24 at 256 peers)."""
    ids = sorted(f"{i:02x}" * 32 for i in range(1, 8))
    members = [
        GroupMember(p, None if i == 1 else f"http://h:{9000 + i}") for i, p in enumerate(ids)
    ]
    assert num_reducers(members, 4) == 4 and num_reducers(members, 6) == 0  # 6 have addresses
    group = GroupInfo("g", tuple(members), num_reducers=4)
    assert GroupInfo.from_wire(group.to_wire()) == group
    sizes = [part.numel for part in group.parts(1000)]
    # members 0, 2, 3, 4 (member 1 is in client mode) share the vector; 5 and 6 reduce nothing
    assert sizes == [250, 0, 250, 250, 250, 0, 0]
    assert [len(slices) for slices in group.stream_parts(1000)] == [1, 0, 1, 1, 1, 0, 0]
    for bad in (-1, 7, True, 2.5):  # more reducers than members with an address, or no int
        with pytest.raises(ProtocolViolation, match="reducers"):
            GroupInfo.from_wire({**group.to_wire(), "reducers": bad})
    offered = dict(
        me=members[0], leader=(ids[0], members[0].address), max_size=8,
        aggregation=group.aggregation, max_weight_ratio=group.max_weight_ratio, numel=1000,
    )  # fmt: skip
    check_offered(group, **offered, min_reducers=4)
    with pytest.raises(ProtocolViolation, match="only 4 reducers"):
        check_offered(group, **offered, min_reducers=5)  # the leader's choice of a few refused


def test_part_header_and_chunk_header():
    header = PartHeader("g", 1, 2.5, 100, "uint8", 1024)
    assert PartHeader.from_wire(header.to_wire()) == header
    for change in ({"v": 1}, {"numel": -1}, {"weight": float("nan")}, {"part": "1"}):
        with pytest.raises(ProtocolViolation):
            PartHeader.from_wire({**header.to_wire(), **change})
    assert unpack_chunk_header(pack_chunk_header(3, 40, 2), 3) == (40, 2)
    with pytest.raises(BadChunkError, match="was due"):
        unpack_chunk_header(pack_chunk_header(4, 40), 3)
    with pytest.raises(BadChunkError):
        unpack_chunk_header(b"\x00" * 5, 0)
