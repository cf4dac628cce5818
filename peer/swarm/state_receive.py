"""Receiving a state's bytes: what a download may contain, and where each byte goes.

A :class:`Template` says what a downloader accepts (every expected tensor with exactly its
dtype and shape; others only under a prefix and within a byte cap: a donor cannot make it
allocate more). An :class:`Assembly` is the fresh buffers of one state, allocated from a donor's
layout once, filled by one stream (:mod:`peer.swarm.state_download`) or by the parts of several
(:mod:`peer.swarm.state_split`), and turned into a snapshot only when complete.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dht.net.transport import OutgoingStream
from peer.records.schema import MAX_COUNT
from peer.swarm.state_serve import byte_view, wire_name
from peer.swarm.state_sync import DTYPES, StateSnapshot, StateSyncError

MAX_DIMS = 16
Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def layout_of(tensors: dict[str, torch.Tensor]) -> Layout:
    """What a downloader expects: each tensor's dtype and shape, by name."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


class NotServedYet(StateSyncError):
    """The donor serves no state of the epoch asked for yet (its newest is older)."""


def check_header(header: Any, min_epoch: int) -> tuple[int, list]:
    """``(epoch, layout)`` of a donor's reply header; :class:`StateSyncError` when it has no
    state that recent (:class:`NotServedYet`), is busy, or the header is malformed."""
    if isinstance(header, dict) and header.get("epoch") is None and header.get("busy"):
        raise StateSyncError(f"the donor is busy: {str(header['busy'])[:200]}")
    if not isinstance(header, dict) or header.get("epoch") is None:
        raise NotServedYet("the donor has no state that recent")
    epoch, layout = header["epoch"], header.get("tensors")
    if (
        isinstance(epoch, bool)
        or not isinstance(epoch, int)
        or not min_epoch <= epoch <= MAX_COUNT
        or not isinstance(layout, list)
    ):
        raise StateSyncError("malformed state header")
    return epoch, layout


async def read_into(stream: OutgoingStream, view: memoryview, name: str) -> None:
    """Fill ``view`` from ``stream``'s next chunks."""
    filled = 0
    while filled < len(view):
        num_bytes = await stream.recv_into(view[filled:])
        if num_bytes is None:
            raise StateSyncError(f"state cut short inside tensor {name[:80]!r}")
        filled += num_bytes


@dataclass
class Template:
    """What a download may contain; counts the extra bytes allocated so far."""

    expected: Layout
    extra_prefix: str | None
    max_extra_bytes: int
    compress: bool = False
    extra_bytes: int = 0

    def allocate(self, item: Any) -> tuple[str, torch.Tensor, torch.Tensor | None]:
        """The tensor an entry of the donor's layout fills, and the buffer its bytes arrive in
        when they travel in another dtype (None: straight into the tensor)."""
        try:
            name, dtype_name, shape, wire = item
            dtype, shape = DTYPES[dtype_name], tuple(shape)
        except (TypeError, ValueError, KeyError):
            raise StateSyncError(f"malformed tensor entry {str(item)[:80]}") from None
        if (
            not isinstance(name, str)
            or len(shape) > MAX_DIMS
            or not all(
                isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_COUNT
                for size in shape
            )
        ):
            raise StateSyncError(f"malformed tensor entry {str(item)[:80]}")
        if wire != wire_name(dtype, self.compress):
            raise StateSyncError(f"tensor {name[:80]} sent as {str(wire)[:16]}")
        if name in self.expected:
            if self.expected[name] != (dtype, shape):
                raise StateSyncError(f"unexpected tensor {name[:80]} {dtype_name} {list(shape)}")
        elif self.extra_prefix is not None and name.startswith(self.extra_prefix):
            self.extra_bytes += math.prod(shape) * dtype.itemsize
            if self.extra_bytes > self.max_extra_bytes:
                raise StateSyncError(f"the donor's state exceeds {self.max_extra_bytes} bytes")
        else:
            raise StateSyncError(f"unexpected tensor {name[:80]}")
        tensor = torch.empty(shape, dtype=dtype)
        buffer = torch.empty(shape, dtype=DTYPES[wire]) if wire != dtype_name else None
        return name, tensor, buffer

    def request(self, min_epoch: int, part: tuple[int, int] | None = None) -> dict:
        """The ``state.get`` request for this template (only the expected tensors, unless
        extras are accepted), of one ``part`` ``(index, count)`` or all."""
        names = list(self.expected) if self.extra_prefix is None else None
        request = {
            "min_epoch": min_epoch,
            "names": names,
            "compression": "bf16" if self.compress else "none",
        }
        if part is not None:
            request["part"] = list(part)
        return request


@dataclass
class Assembly:
    """One state's fresh tensors, in the donor's layout order, and the views their wire bytes
    arrive in (a buffer of the wire dtype when it differs)."""

    layout: list
    names: list[str]
    tensors: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    views: list[memoryview] = field(default_factory=list)

    @classmethod
    def allocate(cls, template: Template, layout: list) -> Assembly:
        """Buffers for every entry of ``layout``, each checked against ``template``."""
        assembly = cls(layout, [], {})
        for item in layout:
            name, tensor, buffer = template.allocate(item)
            if name in assembly.tensors:
                raise StateSyncError(f"tensor {name[:80]!r} sent twice")
            assembly.names.append(name)
            assembly.tensors[name] = tensor
            if buffer is not None:
                assembly.buffers[name] = buffer
            assembly.views.append(byte_view(tensor if buffer is None else buffer))
        if missing := set(template.expected) - set(assembly.tensors):
            raise StateSyncError(f"the donor lacks {len(missing)} tensors, e.g. {min(missing)!r}")
        return assembly

    def wire_sizes(self) -> list[tuple[int, int]]:
        """``(wire bytes, wire item bytes)`` of each tensor, in order."""
        sizes = []
        for name, view in zip(self.names, self.views, strict=True):
            wire = self.buffers.get(name, self.tensors[name])
            sizes.append((len(view), wire.element_size()))
        return sizes

    async def finish(self, epoch: int, metadata: object) -> StateSnapshot:
        """The snapshot, once every byte arrived (wire buffers converted off the event loop)."""
        for name, buffer in self.buffers.items():
            await asyncio.to_thread(self.tensors[name].copy_, buffer)
        return StateSnapshot(epoch, self.tensors, metadata if isinstance(metadata, dict) else {})
