"""Peer identity files and signatures."""

from __future__ import annotations

import os
import stat

import pytest

from dht.errors import IdentityError
from dht.identity import PeerIdentity, is_peer_id, verify

pytestmark = pytest.mark.timeout(30)


def test_created_on_first_run_with_mode_0600_and_stable(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    first = PeerIdentity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = PeerIdentity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert is_peer_id(first.peer_id)
    assert PeerIdentity.generate().peer_id != first.peer_id


def test_signatures_verify_only_for_the_signer():
    alice, bob = PeerIdentity.generate(), PeerIdentity.generate()
    signature = alice.sign(b"record")
    assert verify(alice.peer_id, b"record", signature)
    assert not verify(bob.peer_id, b"record", signature)
    assert not verify(alice.peer_id, b"recorD", signature)
    assert not verify("zz" * 32, b"record", signature)
    assert not verify(alice.peer_id, b"record", signature[:10])


def test_refuses_world_readable_and_garbage_files(tmp_path):
    path = tmp_path / "peer.key"
    PeerIdentity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        PeerIdentity.load_or_create(path)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    os.chmod(garbage, 0o600)
    with pytest.raises(IdentityError, match="not a readable key"):
        PeerIdentity.load_or_create(garbage)
