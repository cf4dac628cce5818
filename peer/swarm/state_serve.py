"""The donor's side of one state stream: what a stream may hold, and how many streams a peer may
open (:mod:`peer.swarm.state_sync` holds the protocol and the server).

Memory per stream is bounded whatever the model's size. Every stream of an epoch reads the same
snapshot (no copy per stream); a ``bf16`` stream rounds one chunk's worth of a tensor at a time,
off the event loop, so it holds at most one encoded chunk (``chunk_bytes / 2`` values) while its
write waits. (A bfloat16 copy of each whole tensor per stream let 64 unread streams from 8 fresh
keys grow a peer from 1.0 to 4.0 GiB, issue 29.)

Streams are counted in shares (:class:`dht.net.shares.FairBudget`): at most ``max_streams`` in
all, ``max_streams_per_peer`` per proven peer id and ``max_streams_per_address`` per source
address (an IPv6 /64 counts as one). A stream over its share is answered ``{"epoch": None,
"busy": reason}`` at once, and the downloader tries another donor. Each stream ends within
``serve_timeout_s`` (a reader that takes a byte now and then cannot hold it longer), and a write
that waits longer than the transport's ``stream_write_timeout_s`` cuts it. Streams keep the
snapshot they started with alive: when more than ``max_old_snapshots`` snapshots the server has
moved past are held by streams, the streams of the oldest are cut at once. Whatever a stream
held is released as its handler returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator

import torch

from dht.net.shares import FairBudget, OverShare
from dht.net.transport import IncomingStream
from peer.records.schema import MAX_COUNT
from peer.swarm.state_digest import bf16_rounded_bits


def bf16_wire_bytes(tensor: torch.Tensor) -> bytes:
    """A float32 tensor as bfloat16 on the wire (little-endian), rounded as the bf16 digest
    rounds it, in numpy: off torch's thread pool, since this runs beside the training thread."""
    return (bf16_rounded_bits(tensor) >> 16).astype("<u2").tobytes()


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


COMPRESSIONS = ("none", "bf16")
# A download split across donors asks each for one of at most this many parts.
MAX_PARTS = 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_name(dtype: torch.dtype, compress: bool) -> str:
    """How a tensor of ``dtype`` travels: bfloat16 for float32 under compression, else as is."""
    return "bfloat16" if compress and dtype == torch.float32 else dtype_name(dtype)


def wire_item_bytes(tensor: torch.Tensor, compress: bool) -> int:
    """Bytes per element of ``tensor`` on the wire."""
    return 2 if compress and tensor.dtype == torch.float32 else tensor.element_size()


@dataclasses.dataclass(frozen=True)
class Request:
    """A well-typed ``state.get`` request: a state of ``min_epoch`` or later, the tensors
    ``names`` (None: all), float32 as bfloat16 when ``compress``, and only the bytes of
    ``part`` ``(index, count)`` (None: all; see :func:`part_ranges`)."""

    min_epoch: int
    names: list[str] | None
    compress: bool
    part: tuple[int, int] | None


def parse_request(header: object) -> Request | None:
    """The request in a stream's header, or None when anything in it is not well typed."""
    if not isinstance(header, dict):
        return None
    wanted, names = header.get("min_epoch", 0), header.get("names")
    compression, part = header.get("compression", "none"), header.get("part")
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted <= MAX_COUNT:
        return None
    if names is not None and not (
        isinstance(names, list) and all(isinstance(n, str) for n in names)
    ):
        return None
    if compression not in COMPRESSIONS:
        return None
    if part is not None:
        if not (
            isinstance(part, list)
            and len(part) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in part)
            and 0 <= part[0] < part[1] <= MAX_PARTS
        ):
            return None
        part = (part[0], part[1])
    return Request(wanted, names, compression == "bf16", part)


@dataclasses.dataclass(eq=False)
class _Stream:
    """One stream being served: the snapshot it reads (by identity) and its deadline."""

    snapshot_id: int
    snapshot_bytes: int
    timeout: asyncio.Timeout


class ServeLimits:
    """The streams being served, their shares, and what they hold (the server's accounting).

    Args:
        max_streams, max_streams_per_peer, max_streams_per_address: the stream shares (see the
            module docstring).
        max_old_snapshots: snapshots past the server's current ones that streams may keep.
        serve_timeout_s: the longest one stream is served, in seconds.
    """

    def __init__(
        self,
        *,
        max_streams: int,
        max_streams_per_peer: int,
        max_streams_per_address: int,
        max_old_snapshots: int,
        serve_timeout_s: float,
    ):
        self.streams = FairBudget(
            max_total=max_streams,
            max_per_peer=max_streams_per_peer,
            max_per_address=max_streams_per_address,
            unit="state streams",
        )
        self.max_old_snapshots = max_old_snapshots
        self.serve_timeout_s = serve_timeout_s
        self._open: list[_Stream] = []
        self.chunk_bytes_held = 0  # encoded chunks that streams hold while their writes wait
        self.max_chunk_bytes_held = 0  # the most ever held at once
        self.num_busy = 0  # streams refused for their share
        self.num_cut = 0  # streams cut because their snapshot was too old
        self.bytes_served = 0  # tensor bytes sent, all streams together

    @property
    def num_streams(self) -> int:
        return len(self._open)

    def snapshot_bytes_held(self, current: set[int]) -> int:
        """Bytes of the snapshots that only streams keep (not those of ``current`` ids)."""
        held = {s.snapshot_id: s.snapshot_bytes for s in self._open}
        return sum(size for snapshot_id, size in held.items() if snapshot_id not in current)

    @contextlib.asynccontextmanager
    async def admit(
        self, stream: IncomingStream, snapshot: object, size: int
    ) -> AsyncIterator[_Stream]:
        """Count ``stream`` (serving ``snapshot`` of ``size`` bytes) for as long as the block
        runs, within ``serve_timeout_s`` (then ``TimeoutError``); :class:`OverShare` when it is
        over a share."""
        with self.streams.account(stream.sender, stream.remote_host) as account:
            try:
                account.charge(1)
            except OverShare:
                self.num_busy += 1
                raise
            async with asyncio.timeout(self.serve_timeout_s) as timeout:
                entry = _Stream(id(snapshot), size, timeout)
                self._open.append(entry)
                try:
                    yield entry
                finally:
                    self._open.remove(entry)

    def moved_on(self, current: set[int]) -> None:
        """The server now holds the snapshots of ``current`` ids: cut the streams of the oldest
        others beyond ``max_old_snapshots`` (their timeouts fire now)."""
        old = list(dict.fromkeys(s.snapshot_id for s in self._open if s.snapshot_id not in current))
        doomed = set(old[: max(0, len(old) - self.max_old_snapshots)])
        now = asyncio.get_running_loop().time()
        for entry in self._open:
            if entry.snapshot_id in doomed:
                self.num_cut += 1
                entry.timeout.reschedule(now)

    @contextlib.contextmanager
    def holding(self, num_bytes: int) -> Iterator[None]:
        """Count an encoded chunk held while its write waits."""
        self.chunk_bytes_held += num_bytes
        self.max_chunk_bytes_held = max(self.max_chunk_bytes_held, self.chunk_bytes_held)
        try:
            yield
        finally:
            self.chunk_bytes_held -= num_bytes


def part_ranges(sizes: list[tuple[int, int]], index: int, count: int) -> list[tuple[int, int, int]]:
    """The byte ranges of part ``index`` of ``count`` of a state whose tensors take ``sizes``
    ``(wire bytes, wire item size)`` in order: ``(tensor index, start, end)`` in the tensor's
    wire bytes. The parts split the concatenated bytes into runs of about equal length, each
    boundary rounded down to a whole element within its tensor, so the parts tile the state
    exactly (a huge tensor is shared by several donors)."""
    total = sum(num_bytes for num_bytes, _ in sizes)
    low, high = total * index // count, total * (index + 1) // count
    ranges, offset = [], 0
    for tensor_index, (num_bytes, item_bytes) in enumerate(sizes):
        start = _local(low - offset, num_bytes, item_bytes)
        end = _local(high - offset, num_bytes, item_bytes) if index + 1 < count else num_bytes
        if end > start:
            ranges.append((tensor_index, start, end))
        offset += num_bytes
    return ranges


def _local(boundary: int, num_bytes: int, item_bytes: int) -> int:
    clamped = min(max(boundary, 0), num_bytes)
    return clamped - clamped % item_bytes if clamped < num_bytes else num_bytes


async def send_tensors(
    stream: IncomingStream,
    tensors: list[torch.Tensor],
    *,
    compress: bool,
    chunk_bytes: int,
    limits: ServeLimits,
) -> None:
    """Send ``tensors``' bytes in order, ``chunk_bytes`` at a time (float32 as bfloat16 when
    ``compress``, encoded one chunk at a time)."""
    ranges = [(tensor, 0, -1) for tensor in tensors]
    await send_ranges(stream, ranges, compress=compress, chunk_bytes=chunk_bytes, limits=limits)


async def send_ranges(
    stream: IncomingStream,
    ranges: list[tuple[torch.Tensor, int, int]],
    *,
    compress: bool,
    chunk_bytes: int,
    limits: ServeLimits,
) -> None:
    """Send the wire bytes ``[start, end)`` of each tensor in order (``end`` -1: to its end),
    ``chunk_bytes`` at a time; see :func:`send_tensors`."""
    for tensor, start, end in ranges:
        if compress and tensor.dtype == torch.float32:
            flat = tensor.reshape(-1)
            first, last = start // 2, (flat.numel() if end < 0 else end // 2)
            step = max(1, chunk_bytes // 2)
            for begin in range(first, last, step):
                piece = await asyncio.to_thread(
                    bf16_wire_bytes, flat[begin : min(last, begin + step)]
                )
                with limits.holding(len(piece)):
                    await stream.send(piece)
                limits.bytes_served += len(piece)
                del piece  # released before the next one is encoded
        else:
            view = byte_view(tensor)
            view = view[start : len(view) if end < 0 else end]
            for begin in range(0, len(view), chunk_bytes):
                piece = view[begin : begin + chunk_bytes]
                await stream.send(piece)
                limits.bytes_served += len(piece)


async def serve_snapshot(
    stream: IncomingStream,
    snapshot,
    request: Request,
    *,
    chunk_bytes: int,
    limits: ServeLimits,
) -> None:
    """Reply with ``snapshot``'s layout (of the tensors asked for) and metadata, then their
    bytes (only those of the part asked for), within the stream's share; :class:`OverShare`
    before anything is sent when the share is taken."""
    wanted = None if request.names is None else set(request.names)
    chosen = {n: t for n, t in snapshot.tensors.items() if wanted is None or n in wanted}
    size = sum(t.numel() * t.element_size() for t in snapshot.tensors.values())
    compress = request.compress
    async with limits.admit(stream, snapshot, size):
        layout = [
            [name, dtype_name(t.dtype), list(t.shape), wire_name(t.dtype, compress)]
            for name, t in chosen.items()
        ]
        reply = {"epoch": snapshot.epoch, "tensors": layout, "metadata": snapshot.metadata}
        tensors = list(chosen.values())
        ranges = [(tensor, 0, -1) for tensor in tensors]
        if request.part is not None:  # the whole layout, and the bytes of this part only
            reply["part"] = list(request.part)
            sizes = [
                (t.numel() * wire_item_bytes(t, compress), wire_item_bytes(t, compress))
                for t in tensors
            ]
            ranges = [(tensors[i], a, b) for i, a, b in part_ranges(sizes, *request.part)]
        await stream.reply(reply)
        await send_ranges(stream, ranges, compress=compress, chunk_bytes=chunk_bytes, limits=limits)
