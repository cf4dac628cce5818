"""Keys, subkeys and values of ``peer.DHT`` as a hivemind user writes them.

hivemind takes any msgpack-serializable key and subkey and gives a stored tuple back as a
tuple. Our node takes str or bytes keys and str, bytes or int subkeys; here:

* a key of another type (a tuple, an int, ...) is stored under the bytes
  ``KEY_PREFIX + msgpack(key)`` (tuples as tuples), the same bytes for the same key on every
  peer, so every ``peer.DHT`` finds it;
* a subkey of another type is packed the same way, and read back as the original;
* tuples in a value travel as the tuple extension of :mod:`dht.net.wire` and read back as
  tuples (readers older than it ignore such a value; tuple-free values are stored byte for
  byte as before).

Nothing is ever unpickled: the packed forms are msgpack, read under the node's limits.
"""

from __future__ import annotations

from typing import Any

from dht.errors import BadMessageError
from dht.kademlia.storage import ValueWithExpiration
from dht.net.wire import MessageLimits, pack, unpack, with_tuples

KEY_PREFIX = b"vp-msgpack-key/1:"
_LIMITS = MessageLimits()


def _packed(obj: Any, *, argument: str) -> bytes:
    try:
        return KEY_PREFIX + pack(with_tuples(obj))
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{argument}: msgpack cannot pack {type(obj).__name__}: {e}") from None


def dht_key(key: Any) -> str | bytes:
    """The key the node stores ``key`` under (str and bytes as they are).

    Raises:
        TypeError: ``key`` cannot be packed (naming ``key``).
    """
    if isinstance(key, str | bytes):
        return key
    return _packed(key, argument="key")


def dht_subkey(subkey: Any) -> Any:
    """The subkey the node stores ``subkey`` under (None, str, bytes and int as they are)."""
    if subkey is None or isinstance(subkey, str | bytes) or type(subkey) is int:
        return subkey
    return _packed(subkey, argument="subkey")


def user_subkey(subkey: Any) -> Any:
    """The subkey a user stored (the inverse of :func:`dht_subkey`)."""
    if isinstance(subkey, bytes) and subkey.startswith(KEY_PREFIX):
        try:
            return unpack(subkey[len(KEY_PREFIX) :], _LIMITS, tuples=True)
        except BadMessageError:
            return subkey  # someone else's bytes that merely start like ours
    return subkey


def stored_value(value: Any) -> Any:
    """What the node packs for ``value``: its tuples as the tuple extension."""
    return with_tuples(value)


def user_result(found: ValueWithExpiration | None) -> ValueWithExpiration | None:
    """A get's result as hivemind gives it: ``(value, expiration_time)`` or None; a dictionary
    value as ``{subkey: (value, expiration_time)}`` with the users' subkeys."""
    if found is None or not isinstance(found.value, dict):
        return found
    entries = {user_subkey(subkey): entry for subkey, entry in found.value.items()}
    return ValueWithExpiration(entries, found.expiration_time)
