"""Owner subkeys: a subkey that names the one peer allowed to write it.

A subkey made by :func:`owner_subkey` (``"peer:" + peer_id``) names its owner; its records are
signed by that owner (:mod:`dht.kademlia.validation`). Storage gives owned records priority over
records anyone may write (:mod:`dht.kademlia.storage`), so both modules read ownership from here.
"""

from __future__ import annotations

from dht.identity import is_peer_id

OWNER_PREFIX = "peer:"
Subkey = str | bytes | int


def owner_subkey(peer_id: str) -> str:
    """The subkey under which only ``peer_id`` may write (its records are signed)."""
    if not is_peer_id(peer_id):
        raise ValueError(f"not a peer id: {peer_id!r}")
    return OWNER_PREFIX + peer_id


def subkey_owner(subkey: Subkey | None) -> str | None:
    """The peer id a subkey is bound to, or None if anyone may write it."""
    if isinstance(subkey, str) and subkey.startswith(OWNER_PREFIX):
        return subkey[len(OWNER_PREFIX) :]
    return None
