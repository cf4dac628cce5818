"""Property tests of the swarm's wire parsers (the group description, the part header, a named
candidate, a state request): whatever arrives, each either returns a bounded value or raises its
one typed error (``ProtocolViolation``), never anything else."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from averaging.allreduce.protocol import PartHeader
from averaging.bounds import MAX_BANDWIDTH, MAX_WEIGHT, check_address
from averaging.errors import ProtocolViolation
from averaging.matchmaking.group import GroupInfo
from averaging.matchmaking.search import CLIENT_RANK, Search
from peer.swarm.state_serve import MAX_PARTS
from peer.swarm.state_serve import parse_request as parse_state_request

pytestmark = pytest.mark.timeout(120)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**60, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=8)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=16,
)
peer_ids = st.sampled_from(["ab" * 32, "cd" * 32, "ef" * 32]) | values
addresses = st.sampled_from(["http://127.0.0.1:5000", "http://127.0.0.1:5001", None]) | values
members = st.fixed_dictionaries(
    {},
    optional={
        "peer": peer_ids,
        "addr": addresses,
        "bw": st.floats(0, 10) | values,
        "w": st.floats(0, 10) | values,
    },
)
groups = st.fixed_dictionaries(
    {},
    optional={
        "group": st.just("g1") | values,
        "members": st.lists(members, max_size=4) | values,
        "compression": st.sampled_from(["none", "fp16", "uint8"]) | values,
        "chunk": st.sampled_from([1024, 4096]) | values,
        "agg": st.sampled_from(["mean", "trimmed_mean"]) | values,
        "wr": st.sampled_from([8.0, 1.0]) | values,
    },
)


@settings(max_examples=300, deadline=None)
@given(groups | values)
def test_a_group_description_is_bounded_or_refused(raw):
    try:
        group = GroupInfo.from_wire(raw)
    except ProtocolViolation:
        return
    ids = [m.peer_id for m in group.members]
    assert ids == sorted(set(ids))
    for member in group.members:
        assert member.address is None or check_address(member.address)
        assert 0 <= member.bandwidth <= MAX_BANDWIDTH and math.isfinite(member.bandwidth)
        assert 0 <= member.weight <= MAX_WEIGHT and math.isfinite(member.weight)
    try:
        parts = group.parts(100_000)
    except ProtocolViolation:
        return
    assert sum(p.numel for p in parts) == 100_000
    assert all(math.isfinite(w) for w in group.weights().values())


headers = st.fixed_dictionaries(
    {},
    optional={
        "v": st.just(2) | values,
        "group": st.just("g1") | values,
        "part": st.integers(0, 3) | values,
        "weight": st.floats(0, 10) | values,
        "numel": st.integers(0, 10**6) | values,
        "dtype": st.just("float32") | values,
        "compression": st.just("none") | values,
        "chunk": st.integers(1, 4096) | values,
    },
)


@settings(max_examples=300, deadline=None)
@given(headers | values)
def test_a_part_header_is_typed_or_refused(raw):
    try:
        header = PartHeader.from_wire(raw)
    except ProtocolViolation:
        return
    assert isinstance(header.numel, int) and header.numel >= 0 and header.chunk_numel >= 1
    assert math.isfinite(header.weight) and header.weight >= 0


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {}, optional={"peer": peer_ids, "addr": addresses, "settled": st.booleans() | values}
    )
    | values
)
def test_a_named_candidate_is_well_formed_or_ignored(raw):
    from averaging.matchmaking.group import GroupMember
    from averaging.rules.compression import Compression

    me = GroupMember("ff" * 32, "http://127.0.0.1:9", 1.0, 1.0)
    search = Search("k", me, 10, Compression.NONE, 0.0, CLIENT_RANK, 2)
    candidate = search.parse_candidate(raw)
    if candidate is not None:
        assert check_address(candidate.address) and candidate.rank < CLIENT_RANK


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "min_epoch": st.integers(0, 10) | values,
            "names": st.lists(st.text(max_size=5), max_size=3) | values,
            "compression": st.sampled_from(["none", "bf16"]) | values,
            "part": st.lists(st.integers(-2, 20), max_size=3) | values,
        },
    )
    | values
)
def test_a_state_request_is_typed_or_answered_with_nothing(raw):
    request = parse_state_request(raw)
    if request is not None:
        assert isinstance(request.min_epoch, int) and 0 <= request.min_epoch < 2**53
        assert request.names is None or all(isinstance(n, str) for n in request.names)
        assert isinstance(request.compress, bool)
        assert request.part is None or 0 <= request.part[0] < request.part[1] <= MAX_PARTS
