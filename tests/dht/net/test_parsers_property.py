"""Property tests of every parser of network input in ``dht``: whatever arrives, the parser
returns a value or raises its one typed error, and what an honest node sends parses back to
itself."""

from __future__ import annotations

import asyncio
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.errors import AuthError, BadMessageError, RemoteError
from dht.identity import PeerIdentity
from dht.kademlia.messages import decode_entry, encode_entry, same_host
from dht.kademlia.storage import ANONYMOUS, DHTStorage, Record, charges
from dht.net import schema
from dht.net.frames import FrameReader
from dht.net.replay import ReplayGuard
from dht.net.session import HelloReply, HelloRequest, PendingHello
from dht.net.session_issuer import SessionIssuer
from dht.net.wire import FRAME_HEADER, MessageLimits, pack, unpack

pytestmark = pytest.mark.timeout(120)
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = MessageLimits(max_body_bytes=1 << 16, max_chunk_bytes=1 << 16, max_msgpack_depth=8)

# Anything msgpack can carry: what a stranger can make a node unpack.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=80),
    st.binary(max_size=80),
)
anything = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(
            st.one_of(st.text(max_size=10), st.integers(-(2**63), 2**63)), children, max_size=6
        ),
    ),
    max_leaves=30,
)
peer_ids = st.binary(min_size=32, max_size=32).map(bytes.hex)
hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
    st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9](\.[a-z][a-z0-9]{0,10}){0,3}", fullmatch=True),
)
addresses = st.builds(
    lambda scheme, host, port: f"{scheme}://{host}:{port}",
    st.sampled_from(["http", "https"]),
    hosts,
    st.integers(min_value=1, max_value=65535),
)
expirations = st.floats(min_value=1.0, max_value=2.0**52, allow_nan=False)
subkeys = st.one_of(
    st.text(max_size=40), st.binary(max_size=40), st.integers(min_value=-(2**63), max_value=2**63)
)
signatures = st.one_of(st.none(), st.binary(min_size=64, max_size=64))
key_ids = st.binary(min_size=20, max_size=20)
MODELS = [
    schema.PingRequest,
    schema.FindRequest,
    schema.StoreRequest,
    schema.PingAnswer,
    schema.FindAnswer,
    schema.StoreAnswer,
]


def maybe_with(obj, extra):
    """``obj`` with a few of its fields replaced by arbitrary values (a near miss)."""
    if isinstance(obj, dict) and extra:
        return {**obj, **extra}
    return obj


@PROPERTY
@given(st.binary(max_size=300))
def test_unpack_raises_only_bad_message(data):
    try:
        unpack(data, LIMITS)
    except BadMessageError:
        pass


@PROPERTY
@given(anything)
def test_unpack_of_packed_is_identity_within_limits(obj):
    packed = pack(obj)
    try:
        back = unpack(packed, LIMITS)
    except BadMessageError:
        return  # deeper than the limit: refused, which is the point
    assert pack(back) == packed


@PROPERTY
@given(
    st.sampled_from(MODELS), anything, st.dictionaries(st.text(max_size=8), anything, max_size=3)
)
def test_schema_raises_only_bad_message(model, obj, extra):
    for candidate in (obj, maybe_with(obj, extra)):
        try:
            schema.parse(model, candidate)
        except BadMessageError:
            pass


@PROPERTY
@given(
    st.one_of(st.none(), addresses),
    st.lists(
        st.tuples(key_ids, st.one_of(st.none(), subkeys), st.binary(max_size=50), expirations,
                  signatures),
        max_size=schema.MAX_RECORDS_PER_STORE,
    ),
)  # fmt: skip
def test_valid_store_requests_parse_back_to_themselves(addr, records):
    wire = unpack(pack({"addr": addr, "records": [list(r) for r in records]}), LIMITS)
    parsed = schema.parse(schema.StoreRequest, wire)
    assert parsed.addr == addr
    assert [tuple(r) for r in parsed.records] == [
        (k, s, v, float(e), sig) for k, s, v, e, sig in records
    ]


@PROPERTY
@given(
    peer_ids,
    st.dictionaries(peer_ids, addresses, max_size=20),
    st.one_of(
        st.none(),
        st.tuples(st.binary(max_size=50), expirations).map(lambda t: Record(t[0], t[1])),
        st.dictionaries(
            subkeys,
            st.builds(Record, st.binary(max_size=50), expirations, signatures),
            min_size=1,
            max_size=5,
        ),
    ),
)
def test_valid_find_answers_parse_back_to_themselves(peer_id, nodes, entry):
    wire = unpack(pack({"peer_id": peer_id, "nodes": nodes, "entry": encode_entry(entry)}), LIMITS)
    parsed = schema.parse(schema.FindAnswer, wire)
    assert parsed.peer_id == peer_id and parsed.nodes == nodes
    assert decode_entry(parsed.entry, 1 << 16) == entry


@PROPERTY
@given(st.one_of(st.text(max_size=300), anything))
def test_addresses_raise_only_bad_message(text):
    try:
        accepted = schema.parse_address(text)
    except BadMessageError:
        return
    assert accepted.startswith(("http://", "https://"))


@PROPERTY
@given(addresses)
def test_valid_addresses_are_accepted(address):
    assert schema.parse_address(address) == address


@pytest.mark.parametrize(
    "address",
    [
        "ftp://1.2.3.4:80",
        "http://1.2.3.4",  # no port
        "http://1.2.3.4:0",
        "http://1.2.3.4:65536",
        "http://user@1.2.3.4:80",
        "http://1.2.3.4:80/path",
        "http://1.2.3.4:80?q=1",
        "http://:80",
        "http://bad_host:80",
        "http://" + "a" * 300 + ":80",
        "mem://3",  # only the in-memory transport speaks mem
    ],
)
def test_bad_addresses_are_refused(address):
    with pytest.raises(BadMessageError):
        schema.parse_address(address)


@PROPERTY
@given(anything)
def test_hello_parsers_raise_only_bad_message(obj):
    for parser in (HelloRequest.parse, HelloReply.parse):
        try:
            parser(obj)
        except BadMessageError:
            pass


def test_hello_round_trip_and_forgeries():
    caller, node = PeerIdentity.generate(), PeerIdentity.generate()
    issuer = SessionIssuer(node, swarm_key=None, lifetime_s=60)
    pending = PendingHello(caller)
    hello = HelloRequest.parse(unpack(pack(pending.request.to_wire()), LIMITS))
    issuer.check_hello(hello)
    reply = issuer.answer(hello)
    session = pending.finish(unpack(pack(reply.to_wire()), LIMITS), swarm_key=None)
    proven = issuer.open_ticket(session.ticket)
    assert (session.peer_id, proven.peer_id, proven.key) == (
        node.peer_id,
        caller.peer_id,
        session.key,
    )
    # A hello naming another peer than the one who signed it
    forged = HelloRequest(node.peer_id, hello.eph, hello.ts, hello.nonce, hello.sig)
    with pytest.raises(AuthError):
        issuer.check_hello(forged)
    # A reply signed by another node than the one it names
    impostor = SessionIssuer(PeerIdentity.generate(), swarm_key=None, lifetime_s=60)
    wire = impostor.answer(hello).to_wire()
    with pytest.raises(AuthError):
        PendingHello(caller).finish({**wire, "peer": node.peer_id}, swarm_key=None)
    # A different swarm key gives a different session key: no request of a non-member verifies
    keyed = SessionIssuer(node, swarm_key=b"k" * 32, lifetime_s=60)
    other = PendingHello(caller)
    keyed_session = other.finish(keyed.answer(other.request).to_wire(), swarm_key=None)
    assert keyed.open_ticket(keyed_session.ticket).key != keyed_session.key


@PROPERTY
@given(st.text(max_size=300))
def test_tickets_raise_only_auth_errors(ticket):
    issuer = SessionIssuer(PeerIdentity.generate(), swarm_key=None, lifetime_s=60)
    with pytest.raises(AuthError):
        issuer.open_ticket(ticket)


@PROPERTY
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["n1", "n2", "n3"]),
                  st.floats(min_value=-100, max_value=100)),
        max_size=60,
    ),
    st.integers(min_value=1, max_value=8),
)  # fmt: skip
def test_replay_guard_accepts_each_nonce_once_in_bounded_memory(requests, max_entries):
    guard = ReplayGuard(window_s=30.0, max_entries=max_entries)
    accepted = set()
    now = 1_000_000.0
    for sender, nonce, offset in requests:
        try:
            guard.check(sender, nonce, repr(now + offset), now_s=now)
        except AuthError:
            continue
        # A replay repeats the timestamp too (the MAC covers it): that triple never passes twice.
        assert (sender, nonce, offset) not in accepted
        assert abs(offset) <= 30.0
        accepted.add((sender, nonce, offset))
        assert len(guard) <= max_entries


async def _read_all(data: bytes) -> list:
    source = asyncio.StreamReader()
    source.feed_data(data)
    source.feed_eof()
    reader = FrameReader(source, limits=LIMITS, idle_timeout_s=1.0)
    out = [await reader.read_message()]
    while (chunk := await reader.read_chunk()) is not None:
        out.append(chunk)
    return out


@PROPERTY
@given(
    st.one_of(
        st.binary(max_size=200),
        st.lists(st.tuples(st.integers(0, 4), st.binary(max_size=40)), max_size=5).map(
            lambda frames: b"".join(
                FRAME_HEADER.pack(kind, len(p) + extra) + p
                for (kind, p), extra in zip(frames, [0, 1, 0, 2, 0], strict=False)
            )
        ),
    )
)
def test_frame_reader_raises_only_typed_errors(data):
    try:
        asyncio.run(_read_all(data))
    except (BadMessageError, RemoteError):
        pass


@PROPERTY
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.one_of(st.none(), st.sampled_from(["x", "y"]),
                      st.sampled_from(["peer:" + "a" * 64, "peer:" + "b" * 64])),
            st.integers(0, 3000),
            st.floats(min_value=1, max_value=500),
        ),
        max_size=80,
    )
)  # fmt: skip
def test_storage_accounting_matches_what_is_held(stores):
    clock = type("Clock", (), {"time": lambda self: 1000.0})()
    storage = DHTStorage(
        clock, max_records=50, max_bytes=20_000, max_bytes_per_key=8000,
        max_bytes_per_owner=6000, max_unowned_bytes_per_key=3000, max_unowned_bytes=9000,
    )  # fmt: skip
    for key_id, subkey, size, ttl in stores:
        storage.store(key_id, Record(os.urandom(size), 1000.0 + ttl), subkey)
    held = [storage.get(k) for k in storage.keys()]
    totals: dict[str, int] = {}
    for entry in held:
        entry_charges = charges(entry)
        assert sum(entry_charges.values()) <= 8000
        assert entry_charges.get(ANONYMOUS, 0) <= 3000
        for owner, num_bytes in entry_charges.items():
            totals[owner] = totals.get(owner, 0) + num_bytes
    assert storage.num_bytes == sum(totals.values()) <= 20_000
    assert all(storage.owner_bytes(o) == b for o, b in totals.items())
    assert all(b <= 6000 for o, b in totals.items() if o != ANONYMOUS)
    assert totals.get(ANONYMOUS, 0) <= 9000
    assert len(storage) <= 50
    assert math.isfinite(storage.num_bytes)


@pytest.mark.parametrize(
    ("address", "remote_host", "same"),
    [
        ("http://127.0.0.1:80", "127.0.0.1", True),
        ("http://127.0.0.1:80", "127.0.0.2", False),
        ("http://10.0.0.5:80", "::ffff:10.0.0.5", True),  # a dual-stack listener's view
        ("http://[::1]:80", "::1", True),
        ("http://node.example:80", "10.0.0.5", False),  # a name: only a ping back can tell
        ("mem://3", "mem://3", True),
        ("mem://3", "mem://4", False),
    ],
)
def test_a_claimed_address_is_on_the_senders_host_or_checked(address, remote_host, same):
    assert same_host(address, remote_host) is same
