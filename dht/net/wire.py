"""Wire formats: msgpack control messages under limits, and the frame format of binary streams.

Control messages are msgpack. Decoding is bounded: msgpack's own per-container limits cap string,
binary, array and map lengths; nesting depth is checked after decoding (the body size is already
capped, so the walk is cheap). Nothing is ever unpickled.

A stream body is a sequence of frames, each ``[kind: u8][length: u32 LE][payload][tag]`` where the
tag is a 16-byte truncated HMAC when the swarm has a key (see :mod:`dht.net.auth`) and absent
otherwise. The first frame of each direction is a msgpack header; binary frames follow; an error
frame ends a stream early with a reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from dht.errors import BadMessageError, ConfigError

FRAME_HEADER = struct.Struct("<BI")
FRAME_MSG = 1  # msgpack payload (the first frame of each direction)
FRAME_BIN = 2  # raw bytes (a chunk of a tensor, say)
FRAME_ERROR = 3  # msgpack {"reason": str}; the sender gives up on this stream


@dataclass(frozen=True, kw_only=True)
class MessageLimits:
    """Bounds on what a node accepts from the network.

    Attributes:
        max_body_bytes: largest RPC request or response body, in bytes.
        max_chunk_bytes: largest payload of one stream frame, in bytes.
        max_msgpack_depth: deepest nesting of msgpack containers accepted.
        max_msgpack_len: most elements in one msgpack array or map, and most bytes in one
            string or binary field (also bounded by ``max_body_bytes``).
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_chunk_bytes: int = 8 * 1024 * 1024
    max_msgpack_depth: int = 16
    max_msgpack_len: int = 100_000

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_chunk_bytes", "max_msgpack_depth", "max_msgpack_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")


# The one msgpack extension type, in DHT values only: a tuple (the payload is the msgpack array
# of its items), so that a value stored as a tuple is read back as one. Nothing else is decoded
# from an extension, and RPC bodies take none.
TUPLE_EXT_CODE = 1


def pack(obj: Any) -> bytes:
    """Serialize a control message (dicts, lists, str, bytes, numbers, None, bool)."""
    return msgpack.packb(obj, use_bin_type=True)


def with_tuples(obj: Any) -> Any:
    """``obj`` with each tuple (at any depth, dict keys too) made the tuple extension, so that
    :func:`pack` keeps it a tuple for readers that pass ``tuples=True`` to :func:`unpack`
    (plain :func:`pack` writes a tuple as an array, which reads back as a list)."""
    if isinstance(obj, tuple):
        return msgpack.ExtType(TUPLE_EXT_CODE, pack([with_tuples(item) for item in obj]))
    if isinstance(obj, list):
        return [with_tuples(item) for item in obj]
    if isinstance(obj, dict):
        return {with_tuples(k): with_tuples(v) for k, v in obj.items()}
    return obj


def unpack(data: bytes | memoryview, limits: MessageLimits, *, tuples: bool = False) -> Any:
    """Deserialize a control message received from the network.

    Args:
        data: the message.
        limits: bounds on it.
        tuples: decode the tuple extension (:data:`TUPLE_EXT_CODE`; DHT values); any other
            extension, or any at all without it, is refused.

    Raises:
        BadMessageError: truncated or invalid msgpack, trailing bytes, or a limit exceeded.
    """
    if len(data) > limits.max_body_bytes:
        raise BadMessageError(f"message of {len(data)} bytes exceeds {limits.max_body_bytes}")
    try:
        obj = _unpackb(data, limits, tuples=tuples, depth=1)
    except msgpack.ExtraData as e:
        raise BadMessageError("trailing bytes after msgpack message") from e
    except (ValueError, msgpack.UnpackException, RecursionError, TypeError) as e:
        # some errors have no message (a reserved byte: FormatError()); a reason that ended in
        # ": " lost its last space on the way, as HTTP reason phrases do
        raise BadMessageError(f"malformed msgpack: {str(e) or type(e).__name__}") from e
    _check_depth(obj, limits.max_msgpack_depth)
    return obj


def _unpackb(data: bytes | memoryview, limits: MessageLimits, *, tuples: bool, depth: int) -> Any:
    n = limits.max_msgpack_len

    def tuple_ext(code: int, payload: bytes) -> tuple:
        if code != TUPLE_EXT_CODE:
            raise ValueError(f"msgpack extension type {code} is not accepted")
        if depth >= limits.max_msgpack_depth:  # bounds the recursion before the depth walk
            raise ValueError(f"msgpack nesting deeper than {limits.max_msgpack_depth}")
        items = _unpackb(payload, limits, tuples=True, depth=depth + 1)
        if not isinstance(items, list):
            raise ValueError("a tuple extension holds an array")
        return tuple(items)

    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=False,
        max_str_len=min(n * 64, limits.max_body_bytes),
        max_bin_len=limits.max_body_bytes,
        max_array_len=n,
        max_map_len=n,
        max_ext_len=limits.max_body_bytes if tuples else 0,
        **({"ext_hook": tuple_ext} if tuples else {}),
    )


def _check_depth(obj: Any, max_depth: int) -> None:
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > max_depth:
            raise BadMessageError(f"msgpack nesting deeper than {max_depth}")
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, dict | list | tuple)
        )
