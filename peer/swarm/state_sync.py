"""State sync: peers serve their latest state; a newcomer or a laggard downloads it from them.

The state is the model's parameters and buffers, the optimizer's tensors and msgpack metadata
(epoch, optimizer and scheduler scalars), sent as raw little-endian tensor bytes behind a msgpack
header over one transport stream: nothing is unpickled. Donors announce themselves under their own
(signed) subkey of ``{prefix}/state``. A downloader picks donors at random among the most recent
(so that newcomers spread over donors), reads every tensor into fresh buffers, checks sizes, and
only returns a complete state: a cut or refused download is retried with the next donor after a
backoff, and the caller's model is never half-loaded.

Compression (the downloader's choice, ``StateSyncConfig.compression``): ``bf16`` sends every
float32 tensor as bfloat16, half the bytes. bfloat16 keeps float32's exponent range, so nothing
overflows or flushes to zero (optimizer moments stay usable), and each value is rounded to 8
significant bits: ``|x - x'| <= |x| * 2**-8``. In ``grad`` mode the peers never average
parameters, so a newcomer keeps that rounding offset; ``params`` and ``diloco`` average it away at
the next round. The conversions run off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from dht.config import get_dht_time
from dht.errors import ConfigError, DHTError
from dht.node import DHTNode
from dht.periodic import Periodic
from dht.transport import IncomingStream, Transport
from dht.validation import owner_subkey, subkey_owner

logger = logging.getLogger(__name__)
STREAM_NAME = "state.get"
COMPRESSIONS = ("none", "bf16")
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class StateSyncError(Exception):
    """No donor could provide a complete state."""


@dataclass(frozen=True, kw_only=True)
class StateSyncConfig:
    """How state is served and fetched.

    Attributes:
        announce_interval_s: how often a donor re-announces itself, in seconds.
        record_ttl_s: how long a donor's announcement lives, in seconds.
        chunk_bytes: bytes per stream chunk.
        download_timeout_s: bound on one whole download from one donor, in seconds.
        max_attempts: donors tried before giving up.
        backoff_s: wait before the second attempt; doubles for each further one, in seconds.
        fresh_snapshot_timeout_s: how long a donor waits for its training thread to capture a
            snapshot of now before serving its last one, in seconds.
        compression: how a downloader asks for float32 tensors: ``none`` (exact) or ``bf16``
            (half the bytes; see the module docstring).
    """

    announce_interval_s: float = 5.0
    record_ttl_s: float = 30.0
    chunk_bytes: int = 4 * 1024 * 1024
    download_timeout_s: float = 120.0
    max_attempts: int = 4
    backoff_s: float = 0.5
    fresh_snapshot_timeout_s: float = 2.0
    compression: str = "none"

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"compression must be one of {COMPRESSIONS}, got {self.compression!r}"
            )
        for name in ("announce_interval_s", "record_ttl_s", "download_timeout_s", "backoff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.chunk_bytes < 1024:
            raise ConfigError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")


@dataclass(frozen=True)
class StateSnapshot:
    """An immutable copy of a peer's state at one epoch (tensors contiguous, on the CPU)."""

    epoch: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, epoch: int, tensors: dict[str, torch.Tensor], metadata=None):
        """Copy ``tensors`` (call from the thread that owns them, between steps)."""
        copies = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        return cls(epoch, copies, dict(metadata or {}))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _wire_name(dtype: torch.dtype, compress: bool) -> str:
    """How a tensor of ``dtype`` travels: bfloat16 for float32 under compression, else as is."""
    return "bfloat16" if compress and dtype == torch.float32 else _dtype_name(dtype)


class StateServer:
    """Serves the latest snapshot on the transport and announces it on the DHT.

    Args:
        transport: not yet started (the stream handler is added here).
        dht: the node to announce on (its transport is ``transport``).
        prefix: the run's key prefix.
        config: intervals and sizes.
    """

    def __init__(self, *, transport: Transport, dht: DHTNode, prefix: str, config: StateSyncConfig):
        self.dht = dht
        self.key = f"{prefix}/state"
        self.config = config
        self.snapshot: StateSnapshot | None = None
        self.current_epoch: int | None = None  # set by the training thread as epochs pass
        self.snapshot_requested = False
        self._waiting: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._announcer = Periodic(self.announce, config.announce_interval_s, "state-announce")
        transport.add_stream_handler(STREAM_NAME, self._serve)

    def update(self, snapshot: StateSnapshot) -> None:
        """Serve ``snapshot`` from now on; call from the training thread (between steps).

        The training thread checks :attr:`snapshot_requested` after each step (a plain
        attribute read) and captures a fresh snapshot when a downloader is waiting for one.
        """
        self.snapshot = snapshot
        self.snapshot_requested = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_waiting)

    def _wake_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for future in waiting:
            if not future.done():
                future.set_result(None)

    async def _fresh_snapshot(self) -> StateSnapshot | None:
        """Ask the training thread for a snapshot of now; the last one if it does not answer."""
        if self._loop is None:
            return self.snapshot
        future = self._loop.create_future()
        self._waiting.append(future)
        self.snapshot_requested = True
        try:
            async with asyncio.timeout(self.config.fresh_snapshot_timeout_s):
                await future
        except TimeoutError:
            pass  # a training thread busy in a long step: serve the last snapshot
        return self.snapshot

    async def _serve(self, stream: IncomingStream) -> None:
        snapshot = await self._fresh_snapshot()
        request = stream.header if isinstance(stream.header, dict) else {}
        wanted, names = request.get("min_epoch", 0), request.get("names")
        if snapshot is None or not isinstance(wanted, int) or snapshot.epoch < wanted:
            await stream.reply({"epoch": None})
            return
        chosen = {
            name: tensor
            for name, tensor in snapshot.tensors.items()
            if not isinstance(names, list) or name in names
        }
        compress = request.get("compression") == "bf16"
        layout = [
            [name, _dtype_name(t.dtype), list(t.shape), _wire_name(t.dtype, compress)]
            for name, t in chosen.items()
        ]
        await stream.reply(
            {"epoch": snapshot.epoch, "tensors": layout, "metadata": snapshot.metadata}
        )
        step = self.config.chunk_bytes
        for tensor in chosen.values():
            if compress and tensor.dtype == torch.float32:
                tensor = await asyncio.to_thread(tensor.to, torch.bfloat16)
            view = _byte_view(tensor)
            for start in range(0, len(view), step):
                await stream.send(view[start : start + step])

    async def announce(self) -> None:
        """Publish this donor's epoch and address once (nothing to do in client mode)."""
        snapshot = self.snapshot
        if snapshot is None or self.dht.address is None:
            return
        # Snapshots are taken fresh on request, so the epoch to announce is the live one.
        epoch = snapshot.epoch if self.current_epoch is None else self.current_epoch
        now = get_dht_time()
        await self.dht.store(
            self.key,
            {"epoch": epoch, "address": self.dht.address},
            now + self.config.record_ttl_s,
            subkey=owner_subkey(self.dht.peer_id),
        )

    async def __aenter__(self) -> StateServer:
        self._loop = asyncio.get_running_loop()
        self._announcer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop announcing; safe to call twice."""
        await self._announcer.stop()


async def find_donors(
    dht: DHTNode, prefix: str, *, min_epoch: int, rng: random.Random
) -> list[tuple[int, str]]:
    """(epoch, address) of donors, newest announced epoch first, shuffled within an epoch.

    An announced epoch is only a hint (donors capture a fresh snapshot when asked, and announce
    every few seconds), so donors that announced less than ``min_epoch`` are kept, last.
    """
    found = await dht.get(f"{prefix}/state", latest=True)
    donors = []
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            value = item.value
            if (
                subkey_owner(subkey) not in (None, dht.peer_id)
                and isinstance(value, dict)
                and isinstance(value.get("epoch"), int)
                and isinstance(value.get("address"), str)
            ):
                donors.append((value["epoch"], value["address"]))
    rng.shuffle(donors)
    donors.sort(key=lambda donor: (donor[0] < min_epoch, -donor[0]))
    return donors


Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def layout_of(tensors: dict[str, torch.Tensor]) -> Layout:
    """What a downloader expects: each tensor's dtype and shape, by name."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


async def download_state(
    transport: Transport,
    dht: DHTNode,
    prefix: str,
    *,
    min_epoch: int,
    expected: Layout,
    config: StateSyncConfig,
    extra_prefix: str | None = None,
    max_extra_bytes: int = 0,
    rng: random.Random | None = None,
) -> StateSnapshot:
    """Download a complete state of ``min_epoch`` or later, trying donors in turn.

    Each tensor named in ``expected`` must arrive with exactly the expected dtype and shape.
    Other tensors (e.g. optimizer moments that a fresh optimizer does not have yet) are accepted
    only under ``extra_prefix`` and up to ``max_extra_bytes`` in all; without ``extra_prefix``
    only the expected tensors are asked for. A donor cannot make this peer allocate more.

    Raises:
        StateSyncError: no donor, or ``max_attempts`` donors failed.
    """
    rng = rng or random.Random()
    donors = await find_donors(dht, prefix, min_epoch=min_epoch, rng=rng)
    if not donors:
        raise StateSyncError(f"no peer serves state of epoch >= {min_epoch}")
    reasons = []
    for attempt, (_, address) in enumerate(donors[: config.max_attempts]):
        if attempt:
            await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1))
        try:
            async with asyncio.timeout(config.download_timeout_s):
                snapshot = await _download_from(
                    transport,
                    address,
                    min_epoch,
                    _Template(
                        expected, extra_prefix, max_extra_bytes, config.compression == "bf16"
                    ),
                )
            logger.info("downloaded state of epoch %d from %s", snapshot.epoch, address)
            return snapshot
        except (DHTError, StateSyncError, TimeoutError) as e:
            reason = str(e) or type(e).__name__
            reasons.append(f"{address}: {reason}")
            logger.warning("state download from %s failed: %s", address, reason)
    raise StateSyncError("every donor failed: " + "; ".join(reasons))


@dataclass
class _Template:
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
            name, dtype_name, shape, wire_name = item
            dtype, shape = DTYPES[dtype_name], tuple(int(size) for size in shape)
        except (TypeError, ValueError, KeyError):
            raise StateSyncError(f"malformed tensor entry {str(item)[:80]}") from None
        if not isinstance(name, str) or any(size < 0 for size in shape):
            raise StateSyncError(f"malformed tensor entry {str(item)[:80]}")
        if wire_name != _wire_name(dtype, self.compress):
            raise StateSyncError(f"tensor {name[:80]} sent as {str(wire_name)[:16]}")
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
        wire = torch.empty(shape, dtype=DTYPES[wire_name]) if wire_name != dtype_name else None
        return name, tensor, wire


async def _download_from(
    transport: Transport, address: str, min_epoch: int, template: _Template
) -> StateSnapshot:
    names = list(template.expected) if template.extra_prefix is None else None
    request = {
        "min_epoch": min_epoch,
        "names": names,
        "compression": "bf16" if template.compress else "none",
    }
    async with transport.open_stream(address, STREAM_NAME, request) as stream:
        await stream.finish_sending()
        header = await stream.reply_header()
        if not isinstance(header, dict) or header.get("epoch") is None:
            raise StateSyncError("the donor has no state that recent")
        epoch, layout = header["epoch"], header.get("tensors")
        if not isinstance(epoch, int) or epoch < min_epoch or not isinstance(layout, list):
            raise StateSyncError("malformed state header")
        tensors = {}
        for item in layout:
            name, tensor, wire = template.allocate(item)
            if name in tensors:
                raise StateSyncError(f"tensor {name!r} sent twice")
            view, filled = _byte_view(tensor if wire is None else wire), 0
            while filled < len(view):
                num_bytes = await stream.recv_into(view[filled:])
                if num_bytes is None:
                    raise StateSyncError(f"state cut short inside tensor {name!r}")
                filled += num_bytes
            if wire is not None:
                await asyncio.to_thread(tensor.copy_, wire)
            tensors[name] = tensor
        if await stream.recv() is not None:
            raise StateSyncError("more state bytes than the header announced")
        if missing := set(template.expected) - set(tensors):
            raise StateSyncError(f"the donor lacks {len(missing)} tensors, e.g. {min(missing)!r}")
    metadata = header.get("metadata")
    return StateSnapshot(epoch, tensors, metadata if isinstance(metadata, dict) else {})
