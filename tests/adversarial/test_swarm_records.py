"""The record boundary (:mod:`peer.records`): whatever a stranger stores, a parser returns a
record whose every field is typed and in range, or None (counted); it never raises, and nothing
it returns can make the swarm estimate raise on the training thread."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.kademlia.validation import owner_subkey
from peer.records.profile import PROFILE_PHASES, ProfileRecord, parse_profile
from peer.records.progress import PeerProgress, parse_record
from peer.records.rounds import (
    MAX_REASON_CHARS,
    ROUND_STATUSES,
    RoundEntry,
    RoundLogRecord,
    parse_rounds,
)
from peer.records.schema import MAX_COUNT, check_peer_url, rejects
from peer.records.state import (
    EpochDigest,
    StateAnnouncement,
    agreed_digests,
    parse_state,
    replica_outliers,
)
from peer.swarm.progress import ProgressConfig, estimate

pytestmark = pytest.mark.timeout(120)
OWNER = owner_subkey("ab" * 32)
NOW = 1_700_000_000.0

# what msgpack can carry, and then some: huge ints, NaN and infinities, digit strings
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**52, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.just("9" * 401)
    | st.binary(max_size=16)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)
urls = st.sampled_from(
    ["http://127.0.0.1:5000", "https://peer.example:443", "http://[::1]:80/"]
) | st.text(max_size=30)


def fields(names_and_values: dict) -> st.SearchStrategy[dict]:
    """Records with the right field names and anything in them (some fields missing)."""
    return st.fixed_dictionaries({}, optional={name: v for name, v in names_and_values.items()})


progress_like = fields(
    {
        "epoch": values,
        "samples": values,
        "samples_per_s": values,
        "time": values,
        "address": urls | values,
        "client_mode": values,
    }
)


def in_count_range(value: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def check_progress(record: PeerProgress) -> None:
    assert in_count_range(record.epoch) and in_count_range(record.samples)
    assert math.isfinite(record.samples_per_s) and 0 <= record.samples_per_s <= 1e6
    assert math.isfinite(record.time)
    assert record.address is None or check_peer_url(record.address)
    assert isinstance(record.client_mode, bool)


@settings(max_examples=300, deadline=None)
@given(progress_like | values)
def test_progress_parser_never_raises_and_keeps_only_ranged_records(value):
    record = parse_record(OWNER, value, 1e6)
    if record is not None:
        check_progress(record)
        # whatever passed, the estimate on the training thread is a plain computation
        own = PeerProgress("cd" * 32, record.epoch, 0, 10.0, NOW, None, False)
        view = estimate([record], own=own, config=ProgressConfig(target_batch_size=64), now=NOW)
        assert 0 <= view.samples_accumulated <= 2 * 64 and view.epoch <= MAX_COUNT


@settings(max_examples=200, deadline=None)
@given(
    epoch=st.integers(0, MAX_COUNT),
    samples=st.integers(0, MAX_COUNT),
    rate=st.floats(0, 1e12),
    stamp=st.floats(0, 1e11),
    address=st.sampled_from([None, "http://10.0.0.1:31337", "https://a.b:1/"]),
    client_mode=st.booleans(),
)
def test_a_well_formed_progress_record_reads_back(
    epoch, samples, rate, stamp, address, client_mode
):
    value = {
        "epoch": epoch,
        "samples": samples,
        "samples_per_s": rate,
        "time": stamp,
        "address": address,
        "client_mode": client_mode,
        "a_newer_field": [1, 2],
    }
    record = parse_record(OWNER, value, 1e6)
    expected_rate = min(rate, 1e6)
    assert record == PeerProgress(
        "ab" * 32, epoch, samples, expected_rate, stamp, address, client_mode
    )


def test_the_401_digit_samples_record_is_dropped_and_counted():
    """The record that stopped a swarm on main: ``samples`` as a string of 401 digits, then
    ``int()`` of it overflowed float() in the estimate on the training thread."""
    before = rejects.counts["progress"]
    value = {"epoch": 3, "samples": "9" * 401, "samples_per_s": 1.0, "time": NOW}
    assert parse_record(OWNER, value, 1e6) is None
    assert rejects.counts["progress"] == before + 1
    # and the same number as an int (msgpack cannot carry it, but a bug might): dropped
    assert parse_record(OWNER, {**value, "samples": 10**400}, 1e6) is None
    for epoch in (2**53, 2**63 - 1, -1, True, 3.0, "3"):
        assert parse_record(OWNER, {**value, "samples": 1, "epoch": epoch}, 1e6) is None


@pytest.mark.parametrize(
    "address",
    [
        "ftp://127.0.0.1:21",
        "http://127.0.0.1",  # no port
        "http://:5000",
        "http://u:p@127.0.0.1:5000",
        "http://127.0.0.1:5000/path",
        "http://127.0.0.1:5000?x=1",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://127.0.0.1:5000 ",
        "http://exa mple:5000",
        "http://" + "a" * 300 + ":1",
        "",
    ],
)
def test_addresses_must_be_http_urls_with_host_and_port(address):
    value = {"epoch": 1, "samples": 1, "samples_per_s": 1.0, "time": NOW, "address": address}
    assert parse_record(OWNER, value, 1e6) is None


rounds_like = fields(
    {
        "time": values,
        "epoch": values,
        "target_batch_size": values,
        "num_rounds": values,
        "rounds": st.lists(
            fields(
                {
                    "epoch": values,
                    "end_time": values,
                    "status": st.sampled_from([*ROUND_STATUSES, "new"]) | values,
                    "group_size": values,
                    "loss": values,
                    "reason": values,
                    "averaged_fraction": values,
                }
            ),
            max_size=3,
        ),
    }
)


@settings(max_examples=300, deadline=None)
@given(rounds_like | values)
def test_rounds_parser_never_raises_and_keeps_only_ranged_records(value):
    record = parse_rounds(OWNER, value)
    if record is None:
        return
    assert isinstance(record, RoundLogRecord)
    assert in_count_range(record.epoch) and 1 <= record.target_batch_size <= MAX_COUNT
    for entry in record.rounds:
        assert isinstance(entry, RoundEntry) and entry.status in ROUND_STATUSES
        assert in_count_range(entry.epoch) and 1 <= entry.group_size <= MAX_COUNT
        assert 0.0 <= entry.averaged_fraction <= 1.0
        assert entry.loss is None or math.isfinite(entry.loss)


def test_a_published_round_record_reads_back():
    entry = RoundEntry(epoch=4, end_time=NOW, status="ok", group_size=3, loss=float("nan"))
    record = RoundLogRecord(
        peer_id="ab" * 32, time=NOW, epoch=5, target_batch_size=64, rounds=(entry,)
    )
    parsed = parse_rounds(OWNER, record.to_wire())
    # a diverged peer's NaN loss is shown as unknown, not a reason to drop its record
    assert parsed == RoundLogRecord(
        peer_id="ab" * 32,
        time=NOW,
        epoch=5,
        target_batch_size=64,
        rounds=(RoundEntry(epoch=4, end_time=NOW, status="ok", group_size=3, loss=None),),
    )


def test_a_round_that_failed_with_a_long_error_still_reads_back():
    """The averager's error text has no bound; the record keeps its first MAX_REASON_CHARS (a
    24-peer swarm's monitor dropped our own record: 'at most 480 characters')."""
    reason = "matchmaking failed: " + "peer went away; " * 60
    entry = RoundEntry(epoch=4, end_time=NOW, status="failed", reason=reason)
    record = RoundLogRecord(
        peer_id="ab" * 32, time=NOW, epoch=5, target_batch_size=64, rounds=(entry,)
    )
    parsed = parse_rounds(OWNER, record.to_wire())
    assert parsed is not None
    assert parsed.rounds[0].reason == reason[:MAX_REASON_CHARS]


profile_like = fields(
    {
        "time": values,
        "epoch": values,
        "window_s": values,
        "fractions": st.dictionaries(st.sampled_from(PROFILE_PHASES) | st.text(), values),
        "samples_per_s": values,
        "rss_bytes": values,
        "device": values,
        "loss": values,
        "verdict": values,
    }
)


@settings(max_examples=300, deadline=None)
@given(profile_like | values)
def test_profile_parser_never_raises_and_keeps_only_ranged_records(value):
    record = parse_profile(OWNER, value)
    if record is None:
        return
    assert isinstance(record, ProfileRecord)
    assert in_count_range(record.epoch) and in_count_range(record.rss_bytes)
    assert set(record.fractions) <= set(PROFILE_PHASES)
    assert all(0.0 <= share <= 1.0 for share in record.fractions.values())
    assert math.isfinite(record.samples_per_s) and math.isfinite(record.window_s)
    assert len(record.device) <= 32 and len(record.verdict) <= 200


def test_a_published_profile_reads_back():
    record = ProfileRecord(
        peer_id="ab" * 32, time=NOW, epoch=2, window_s=10.0, fractions={"data": 0.5, "idle": 0.5}
    )
    assert parse_profile(OWNER, record.to_wire()) == record


hex_digests = st.text("0123456789abcdef", min_size=64, max_size=64)
state_like = fields(
    {
        "v": values | st.just(3),
        "epoch": values,
        "address": urls | values,
        "digests": st.lists(
            fields({"epoch": values, "digest": values | hex_digests, "digest_bf16": values}),
            max_size=3,
        )
        | values,
    }
)


@settings(max_examples=300, deadline=None)
@given(state_like | values)
def test_state_announcement_parser_never_raises(value):
    record = parse_state(OWNER, value)
    if record is None:
        return
    assert in_count_range(record.epoch)
    assert record.address is None or check_peer_url(record.address)
    for entry in record.digests:
        assert in_count_range(entry.epoch) and int(entry.digest, 16) >= 0


def test_a_published_state_announcement_reads_back():
    digest = EpochDigest(7, "ab" * 32, "cd" * 32)
    announcement = StateAnnouncement("ab" * 32, 7, "http://127.0.0.1:5000", (digest,))
    assert parse_state(OWNER, announcement.to_wire()) == announcement
    # version 1 (no digest) cannot be checked: dropped
    assert parse_state(OWNER, {"epoch": 7, "address": "http://127.0.0.1:5000"}) is None


def test_agreement_needs_distinct_peers_and_outliers_are_marked():
    def announce(peer: int, epoch: int, digest: str) -> StateAnnouncement:
        return StateAnnouncement(f"{peer:064x}", epoch, None, (EpochDigest(epoch, digest * 64),))

    same = [announce(1, 5, "a"), announce(2, 5, "a"), announce(3, 5, "b")]
    assert agreed_digests(same, min_peers=2) == {(5, "a" * 64): 2}
    # one peer announcing twice is one vote
    assert agreed_digests([announce(3, 5, "b"), announce(3, 5, "b")], min_peers=2) == {}
    assert replica_outliers(same) == {f"{3:064x}"}
    assert replica_outliers(same[1:]) == set()  # a tie says nothing


def test_records_under_no_owner_subkey_are_dropped():
    value = {"epoch": 1, "samples": 1, "samples_per_s": 1.0, "time": NOW}
    for subkey in (None, 5, "peer", "not-an-owner"):
        assert parse_record(subkey, value, 1e6) is None
