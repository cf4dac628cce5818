"""Record validation: subkeys bound to a peer may be written only by that peer.

A subkey made by :func:`owner_subkey` (``"peer:" + peer_id``) names its owner. A record under it
travels in a signed envelope: an Ed25519 signature by the owner over (key id, subkey, value bytes,
expiration). Every replica checks it before storing and every reader checks it again, so a record
cannot be forged, moved to another key or subkey, or given a later expiration. A replayed old
record has a valid signature but an older expiration than the stored one, and the storage rules
(:mod:`dht.kademlia.storage`) refuse it.
"""

from __future__ import annotations

from typing import Any, Protocol

from dht.errors import BadMessageError, ValidationError
from dht.identity import SIGNATURE_BYTES, PeerIdentity, public_key_problem, verify
from dht.kademlia.config import DHTConfig
from dht.kademlia.routing import ID_BYTES
from dht.kademlia.storage import Record
from dht.kademlia.subkeys import OWNER_PREFIX, Subkey, owner_subkey, subkey_owner
from dht.net.wire import pack

__all__ = [
    "OWNER_PREFIX",
    "make_record",
    "owner_subkey",
    "sign_record",
    "signed_bytes",
    "subkey_owner",
]
_ENVELOPE_TAG = "vp-dht-record/1"


def signed_bytes(key_id: int, subkey: Subkey, value_bytes: bytes, expiration_time: float) -> bytes:
    """The exact bytes an owner signs for one record."""
    raw_key = key_id.to_bytes(ID_BYTES, "big")
    return pack([_ENVELOPE_TAG, raw_key, subkey, value_bytes, float(expiration_time)])


def sign_record(
    identity: PeerIdentity, key_id: int, subkey: Subkey, value_bytes: bytes, expiration_time: float
) -> Record:
    """A record under ``subkey`` signed by ``identity`` (which must own the subkey)."""
    if subkey_owner(subkey) != identity.peer_id:
        raise ValidationError(f"{identity!r} does not own subkey {subkey!r}")
    signature = identity.sign(signed_bytes(key_id, subkey, value_bytes, expiration_time))
    return Record(value_bytes, float(expiration_time), signature)


def make_record(
    key_id: int,
    value: Any,
    expiration_time: float,
    subkey: Subkey | None,
    *,
    identity: PeerIdentity,
    config: DHTConfig,
    now: float,
) -> Record | str:
    """The record ``identity`` stores (signed under its own subkey), or why it cannot be stored
    (DHT time ``now``).

    Raises:
        TypeError: ``subkey`` is not a str, bytes or int.
        BadMessageError: the value cannot be packed or exceeds ``max_value_bytes``.
    """
    if subkey is not None and (isinstance(subkey, bool) or not isinstance(subkey, Subkey)):
        raise TypeError(f"subkey must be str, bytes or int, got {type(subkey).__name__}")
    try:
        value_bytes = pack(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise BadMessageError(f"value cannot be packed: {e}") from e
    if len(value_bytes) > config.max_value_bytes:
        raise BadMessageError(
            f"value of {len(value_bytes)} bytes exceeds max_value_bytes ({config.max_value_bytes})"
        )
    expiration_time = float(expiration_time)
    if expiration_time <= now:
        return "expiration_time is in the past"
    if expiration_time > now + config.max_expiration_ahead_s:
        return "expiration_time is further ahead than max_expiration_ahead_s"
    owner = subkey_owner(subkey)
    if owner is None:
        return Record(value_bytes, expiration_time)
    if owner != identity.peer_id:
        return f"subkey {subkey!r} belongs to another peer"
    try:
        return sign_record(identity, key_id, subkey, value_bytes, expiration_time)
    except ValidationError as e:
        return str(e)


class RecordValidator(Protocol):
    """Decides whether a record may be stored (and trusted when read)."""

    def validate(self, key_id: int, subkey: Subkey | None, record: Record) -> None:
        """Raise :class:`ValidationError` to refuse the record."""


class OwnerSignatureValidator:
    """Refuses records under an owner subkey unless the owner signed exactly this record."""

    def validate(self, key_id: int, subkey: Subkey | None, record: Record) -> None:
        owner = subkey_owner(subkey)
        if owner is None:
            return
        problem = public_key_problem(owner)
        if problem is not None:
            raise ValidationError(f"owner subkey names no valid peer id ({problem}): {subkey!r}")
        if record.signature is None or len(record.signature) != SIGNATURE_BYTES:
            raise ValidationError(f"record under {subkey!r} is not signed")
        data = signed_bytes(key_id, subkey, record.value_bytes, record.expiration_time)
        if not verify(owner, data, record.signature):
            raise ValidationError(f"bad signature on record under {subkey!r}")
