"""The all-reduce's stream protocol: full-duplex streams per (sender, reducer) part.

A group may carry each part over several streams (``GroupInfo.num_streams``): the part is cut
into slices of whole chunks and each slice is exchanged on a stream of its own, exactly as a
part of that size would be; the header names the slice (``stream``), its ``numel`` is the
slice's, and chunk indices count from the slice's first chunk.

Up (sender to reducer): the stream header (:class:`PartHeader`, msgpack), then for each chunk
``i`` in order a 12-byte chunk header ``[index u32][nbytes u32][0 u32]`` and the chunk's payload
(``nbytes`` bytes in the group's wire format, see :mod:`averaging.rules.compression`). A sender of
weight 0 sends no chunks.

Down (reducer to sender): the reply header ``{"ok": true}``, then for each chunk ``i`` in order a
chunk header ``[index][nbytes][num_contributors]`` and the averaged payload; ``nbytes = 0`` (no
payload) says that nobody's contribution to that chunk arrived, so the sender keeps its own
values there. A reducer that drops a sender ends its reply with an error frame.

A sender whose stream opens after the reducer dropped it for not connecting in time (a process
that got no CPU for a second, on a crowded host) gets the reply header ``{"ok": true, "late":
true}`` instead of a refusal: its chunks are not read and count nowhere, and every average comes
back as to the others, so that its replica ends equal to the group's and not apart from it for
good. A sender that knows no ``late`` refuses the reply, as it would have been refused.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from averaging.errors import BadChunkError, ProtocolViolation
from averaging.rules.compression import Compression

PROTOCOL_VERSION = 2  # 2: weights are the bounded ones of the group (averaging.bounds)
CHUNK_HEADER = struct.Struct("<III")
REPLY_OK = {"ok": True}
REPLY_LATE = {"ok": True, "late": True}  # the averages only: this sender's values count nowhere


@dataclass(frozen=True)
class PartHeader:
    """What a sender announces when it opens the stream of one part.

    Attributes:
        group_id: the group's round.
        part: index of the part (its reducer's position in the group).
        weight: the sender's weight (must match the group's record of it).
        numel: values in the part.
        dtype: always "float32" before compression.
        compression: the wire format of the chunks, both ways.
        chunk_numel: values per chunk (the last one may be shorter).
        stream: which slice of the part this stream carries (0 when the part has one stream).
    """

    group_id: str
    part: int
    weight: float
    numel: int
    compression: Compression
    chunk_numel: int
    dtype: str = "float32"
    stream: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", Compression(self.compression))

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "group": self.group_id,
            "part": self.part,
            "weight": self.weight,
            "numel": self.numel,
            "dtype": self.dtype,
            "compression": self.compression.value,
            "chunk": self.chunk_numel,
            "stream": self.stream,
        }

    @classmethod
    def from_wire(cls, raw: Any) -> PartHeader:
        """Parse a stream header received from the network.

        Raises:
            ProtocolViolation: a field is missing, of the wrong type or out of range.
        """
        if not isinstance(raw, Mapping) or raw.get("v") != PROTOCOL_VERSION:
            raise ProtocolViolation("not an averaging stream header of a known version")
        group_id, weight = raw.get("group"), raw.get("weight")
        if not (isinstance(group_id, str) and 0 < len(group_id) <= 64):
            raise ProtocolViolation("bad group id in stream header")
        for name in ("part", "numel", "chunk", "stream"):
            value = raw.get(name, 0) if name == "stream" else raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolViolation(f"stream header field {name} must be an int >= 0")
        if raw["chunk"] < 1:
            raise ProtocolViolation("stream header chunk must be >= 1")
        if not (
            isinstance(weight, int | float)
            and not isinstance(weight, bool)
            and math.isfinite(weight)
            and weight >= 0
        ):
            raise ProtocolViolation("stream header weight must be a finite number >= 0")
        if raw.get("dtype") != "float32":
            raise ProtocolViolation(f"unsupported dtype {raw.get('dtype')!r}")
        try:
            compression = Compression(raw.get("compression"))
        except ValueError:
            raise ProtocolViolation(f"unknown compression {raw.get('compression')!r}") from None
        return cls(
            group_id,
            raw["part"],
            float(weight),
            raw["numel"],
            compression,
            raw["chunk"],
            stream=raw.get("stream", 0),
        )


def pack_chunk_header(index: int, nbytes: int, num_contributors: int = 0) -> bytes:
    return CHUNK_HEADER.pack(index, nbytes, num_contributors)


def unpack_chunk_header(data: bytes | memoryview, expected_index: int) -> tuple[int, int]:
    """``(nbytes, num_contributors)`` of a chunk header that must announce ``expected_index``.

    Raises:
        BadChunkError: the header is malformed or announces another chunk (out of order).
    """
    if len(data) != CHUNK_HEADER.size:
        raise BadChunkError(f"chunk header of {len(data)} bytes, expected {CHUNK_HEADER.size}")
    index, nbytes, num_contributors = CHUNK_HEADER.unpack(data)
    if index != expected_index:
        raise BadChunkError(f"chunk {index} arrived where chunk {expected_index} was due")
    return nbytes, num_contributors
