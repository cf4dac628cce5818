"""Record validation: subkeys bound to a peer may be written only by that peer.

A subkey made by :func:`owner_subkey` (``"peer:" + peer_id``) names its owner. A record under it
travels in a signed envelope: an Ed25519 signature by the owner over (key id, subkey, value bytes,
expiration). Every replica checks it before storing and every reader checks it again, so a record
cannot be forged, moved to another key or subkey, or given a later expiration. A replayed old
record has a valid signature but an older expiration than the stored one, and the storage rules
(:mod:`dht.kademlia.storage`) refuse it.
"""

from __future__ import annotations

from typing import Protocol

from dht.errors import ValidationError
from dht.identity import SIGNATURE_BYTES, PeerIdentity, public_key_problem, verify
from dht.kademlia.routing import ID_BYTES
from dht.kademlia.storage import Record
from dht.kademlia.subkeys import OWNER_PREFIX, Subkey, owner_subkey, subkey_owner
from dht.net.wire import pack

__all__ = ["OWNER_PREFIX", "owner_subkey", "sign_record", "signed_bytes", "subkey_owner"]
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
