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


def _small_order_by_the_math(peer_id: str) -> bool:
    """RFC 8032 point decoding and [8]P == identity, in plain integers (the reference)."""
    d = -121665 * pow(121666, _P - 2, _P) % _P
    raw = int.from_bytes(bytes.fromhex(peer_id), "little")
    y, sign = raw & ((1 << 255) - 1), raw >> 255
    u, v = (y * y - 1) % _P, (d * y * y + 1) % _P
    x = u * pow(v, 3, _P) * pow(u * pow(v, 7, _P), (_P - 5) // 8, _P) % _P
    if v * x * x % _P == (-u) % _P:
        x = x * pow(2, (_P - 1) // 4, _P) % _P
    assert v * x * x % _P == u, "not on the curve"
    x = x if x & 1 == sign else _P - x
    point = (x, y, 1, x * y % _P)
    for _ in range(3):  # doubling in extended coordinates
        px, py, pz, pt = point
        a, b = (py - px) ** 2 % _P, (py + px) ** 2 % _P
        c, e = 2 * pt * pt * d % _P, 2 * pz * pz % _P
        f, g, h, k = b - a, e - c, e + c, b + a
        point = (f * g % _P, h * k % _P, g * h % _P, f * k % _P)
    return point[0] % _P == 0 and (point[1] - point[2]) % _P == 0


def test_the_list_is_the_small_order_points_and_generated_keys_pass():
    from dht.identity import public_key_problem

    assert all(_small_order_by_the_math(key) for key in SMALL_ORDER_KEYS)
    assert len(set(SMALL_ORDER_KEYS)) == 8
    for _ in range(200):
        peer_id = PeerIdentity.generate().peer_id
        assert not _small_order_by_the_math(peer_id)
        assert public_key_problem(peer_id) is None
    assert public_key_problem("AB" * 32) == "not 64 lowercase hex characters"
