"""Owner subkeys: signed envelopes, forgeries, replays and records moved between keys."""

from __future__ import annotations

import pytest

from dht.errors import ValidationError
from dht.identity import PeerIdentity
from dht.kademlia.routing import DHTID
from dht.kademlia.storage import DHTStorage, Record
from dht.kademlia.validation import (
    OwnerSignatureValidator,
    owner_subkey,
    sign_record,
    signed_bytes,
    subkey_owner,
)
from dht.net.wire import pack

pytestmark = pytest.mark.timeout(30)

NOW = 1_700_000_000.0
KEY = DHTID.from_key("run/progress")


class FakeClock:
    def time(self) -> float:
        return NOW


@pytest.fixture(scope="module")
def alice() -> PeerIdentity:
    return PeerIdentity.generate()


@pytest.fixture(scope="module")
def mallory() -> PeerIdentity:
    return PeerIdentity.generate()


def test_owner_subkey_names_its_owner(alice):
    subkey = owner_subkey(alice.peer_id)
    assert subkey == "peer:" + alice.peer_id
    assert subkey_owner(subkey) == alice.peer_id
    assert subkey_owner("anything") is None and subkey_owner(b"peer:x") is None
    with pytest.raises(ValueError):
        owner_subkey("not-a-peer-id")


def test_owner_signed_record_validates(alice):
    subkey = owner_subkey(alice.peer_id)
    record = sign_record(alice, KEY, subkey, pack({"epoch": 3}), NOW + 60)
    OwnerSignatureValidator().validate(KEY, subkey, record)
    # The envelope is an Ed25519 signature over exactly (key, subkey, value, expiration).
    data = signed_bytes(KEY, subkey, record.value_bytes, NOW + 60)
    assert record.signature == alice.sign(data)


def test_free_subkeys_and_plain_values_need_no_signature():
    validator = OwnerSignatureValidator()
    validator.validate(KEY, None, Record(pack(1), NOW + 1))
    validator.validate(KEY, "anyone", Record(pack(1), NOW + 1))


def test_forged_record_is_refused(alice, mallory):
    subkey = owner_subkey(alice.peer_id)
    validator = OwnerSignatureValidator()
    with pytest.raises(ValidationError, match="not signed"):
        validator.validate(KEY, subkey, Record(pack("forged"), NOW + 60))
    value = pack("forged")
    forged = Record(value, NOW + 60, mallory.sign(signed_bytes(KEY, subkey, value, NOW + 60)))
    with pytest.raises(ValidationError, match="bad signature"):
        validator.validate(KEY, subkey, forged)
    with pytest.raises(ValidationError):
        sign_record(mallory, KEY, subkey, value, NOW + 60)


@pytest.mark.parametrize("tamper", ["value", "expiration", "key", "subkey"])
def test_record_altered_or_moved_is_refused(alice, tamper):
    subkey = owner_subkey(alice.peer_id)
    record = sign_record(alice, KEY, subkey, pack("honest"), NOW + 60)
    key, used_subkey = KEY, subkey
    if tamper == "value":
        record = Record(pack("changed"), record.expiration_time, record.signature)
    elif tamper == "expiration":
        record = Record(record.value_bytes, NOW + 10_000, record.signature)
    elif tamper == "key":
        key = DHTID.from_key("run/other")
    else:
        other = PeerIdentity.generate()
        used_subkey = owner_subkey(other.peer_id)
    with pytest.raises(ValidationError):
        OwnerSignatureValidator().validate(key, used_subkey, record)


def test_malformed_owner_subkey_is_refused(alice):
    record = Record(pack(1), NOW + 60, b"\x00" * 64)
    with pytest.raises(ValidationError, match="no valid peer id"):
        OwnerSignatureValidator().validate(KEY, "peer:zz", record)


def test_replayed_old_record_is_refused_by_storage(alice):
    subkey = owner_subkey(alice.peer_id)
    old = sign_record(alice, KEY, subkey, pack({"epoch": 1}), NOW + 30)
    new = sign_record(alice, KEY, subkey, pack({"epoch": 2}), NOW + 60)
    validator = OwnerSignatureValidator()
    storage = DHTStorage(FakeClock(), max_records=10)
    for record in (old, new):
        validator.validate(KEY, subkey, record)
        assert storage.store(KEY, record, subkey)
    validator.validate(KEY, subkey, old)  # the signature is genuine...
    assert not storage.store(KEY, old, subkey)  # ...but it is older than what is held
    assert storage.get(KEY) == {subkey: new}
