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


# The 8 small-order points of Ed25519, canonically encoded: libsodium's blocklist
# (crypto_sign/ed25519/ref10/open.c) and its sign-bit twins, an independent reference.
_P = 2**255 - 19
SMALL_ORDER_KEYS = [
    "01" + "00" * 31,  # the identity (order 1)
    "ec" + "ff" * 30 + "7f",  # y = p - 1 (order 2)
    "00" * 32,  # y = 0, x = +sqrt(-1) (order 4)
    "00" * 31 + "80",  # y = 0, x = -sqrt(-1) (order 4)
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",  # order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
]


def _encoding(y: int, sign: int = 0) -> str:
    return (y | sign << 255).to_bytes(32, "little").hex()


# Encodings no honest key has: y >= p (p, p + 1, and the all-ones y), and x = 0 with the sign
# bit set (the identity and y = p - 1 written as "negative zero").
NON_CANONICAL_KEYS = [
    _encoding(_P), _encoding(_P + 1), _encoding(2**255 - 1), _encoding(1, 1), _encoding(_P - 1, 1),
]  # fmt: skip


@pytest.mark.parametrize("peer_id", SMALL_ORDER_KEYS + NON_CANONICAL_KEYS)
def test_small_order_and_non_canonical_keys_are_refused(peer_id):
    from dht.identity import public_key_problem

    assert public_key_problem(peer_id) is not None
    # The universal forgery under the identity (R = identity, S = 0) verifies for OpenSSL, which
    # takes any 32 bytes as a key; ours never verifies under a refused key.
    forged = bytes.fromhex("01" + "00" * 31) + bytes(32)
    assert not verify(peer_id, b"any message", forged)


def test_openssl_alone_takes_the_forgery_under_the_identity():
    # Why the check exists: without it, anyone could prove the identity point as its peer id.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    forged = bytes.fromhex("01" + "00" * 31) + bytes(32)
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(SMALL_ORDER_KEYS[0]))
    key.verify(forged, b"any message")  # does not raise


def test_generated_keys_and_bytes_off_the_curve():
    from dht.identity import public_key_problem

    for _ in range(200):
        assert public_key_problem(PeerIdentity.generate().peer_id) is None
    # y = 2 is no point of the curve (x^2 would be a non-residue)
    assert public_key_problem(_encoding(2)) == "not a point of the curve"
    assert public_key_problem("AB" * 32) == "not 64 lowercase hex characters"
