"""Load balancing: which slice of the flattened vector each peer reduces, and its chunks.

Every member of a group computes the same partition from the same group description, so no
message is needed to agree on it. Parts are sized in proportion to the bandwidth each peer
announced; client-mode peers (no server) reduce nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from averaging.rules.compression import UINT8_BLOCK

# Parts are cut into at least this many chunks when they are big enough, so that sending,
# reducing and receiving overlap even for small vectors; chunks never get smaller than the minimum.
MIN_CHUNKS_PER_PART = 4
MIN_CHUNK_NUMEL = 16 * UINT8_BLOCK


@dataclass(frozen=True)
class Part:
    """One reducer's slice ``[start, end)`` of the flattened vector, streamed in chunks.

    Attributes:
        index: position of the part (its reducer's position in the group's member list).
        start: first value of the part in the flattened vector.
        end: one past its last value.
        chunk_numel: values per chunk (the last chunk may be shorter).
        stream: which of the part's streams carries this slice (see :func:`split_streams`;
            0 for a whole part).
    """

    index: int
    start: int
    end: int
    chunk_numel: int
    stream: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def num_chunks(self) -> int:
        return -(-self.numel // self.chunk_numel)

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        """``(lo, hi)`` of chunk ``chunk``, relative to the part's start."""
        lo = chunk * self.chunk_numel
        return lo, min(lo + self.chunk_numel, self.numel)

    def chunk_size(self, chunk: int) -> int:
        lo, hi = self.chunk_bounds(chunk)
        return hi - lo


def part_sizes(total_numel: int, bandwidths: Sequence[float]) -> list[int]:
    """Split ``total_numel`` values in proportion to ``bandwidths`` (0 means no part).

    Largest-remainder rounding, ties to the earlier peer, so that the sizes add up exactly and
    every peer computes the same split.

    Raises:
        ValueError: a negative or non-finite bandwidth, or every bandwidth is 0 while there
            are values to split.
    """
    if any(not (b >= 0 and b != float("inf")) for b in bandwidths):
        raise ValueError(f"bandwidths must be finite and >= 0, got {list(bandwidths)}")
    total_bandwidth = sum(bandwidths)
    if total_bandwidth <= 0:
        if total_numel:
            raise ValueError("no peer can reduce: every bandwidth is 0 (all in client mode?)")
        return [0] * len(bandwidths)
    exact = [total_numel * b / total_bandwidth for b in bandwidths]
    sizes = [int(x) for x in exact]
    remainder = total_numel - sum(sizes)
    by_fraction = sorted(range(len(exact)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_fraction[:remainder]:
        sizes[i] += 1
    return sizes


def chunk_numel_of(part_numel: int, max_chunk_numel: int) -> int:
    """Values per chunk of a part: ``max_chunk_numel``, less for small parts (whole blocks)."""
    quarter = -(-part_numel // MIN_CHUNKS_PER_PART)
    in_blocks = -(-quarter // UINT8_BLOCK) * UINT8_BLOCK
    return max(min(MIN_CHUNK_NUMEL, max_chunk_numel), min(in_blocks, max_chunk_numel))


def make_parts(total_numel: int, bandwidths: Sequence[float], max_chunk_numel: int) -> list[Part]:
    """One :class:`Part` per peer (possibly empty), in the order of ``bandwidths``."""
    parts, start = [], 0
    for index, size in enumerate(part_sizes(total_numel, bandwidths)):
        parts.append(Part(index, start, start + size, chunk_numel_of(size, max_chunk_numel)))
        start += size
    return parts


def split_streams(part: Part, num_streams: int) -> list[Part]:
    """Cut ``part`` into up to ``num_streams`` slices of whole chunks, one per stream.

    The chunks are the part's own, so the chunk boundaries (and the compression's blocks) do
    not depend on how many streams carry them; a part of fewer chunks gets fewer streams. The
    slices are contiguous and in order; slice ``i`` has ``stream == i``.

    Raises:
        ValueError: ``num_streams`` < 1.
    """
    if num_streams < 1:
        raise ValueError(f"num_streams must be >= 1, got {num_streams}")
    num_chunks = part.num_chunks
    num_slices = max(1, min(num_streams, num_chunks))
    slices, first_chunk = [], 0
    for stream in range(num_slices):
        # the first ``num_chunks % num_slices`` slices take one chunk more
        count = num_chunks // num_slices + (stream < num_chunks % num_slices)
        start = part.start + first_chunk * part.chunk_numel
        end = min(part.start + (first_chunk + count) * part.chunk_numel, part.end)
        slices.append(Part(part.index, start, end, part.chunk_numel, stream))
        first_chunk += count
    return slices
