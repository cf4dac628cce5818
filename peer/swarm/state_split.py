"""One state from several donors at once (issue 24, item 4): many newcomers download from many
donors, not all from one.

When the donor a downloader would try first and at least one other serve the same agreed state
(the same digest at the same epoch, their current one), the downloader asks each of up to
``max_split_donors`` of them for one part of it (``part: [index, count]`` in the ``state.get``
request): every donor replies with the whole
layout and the bytes of its part only, a byte range of each tensor's wire bytes
(:func:`peer.swarm.state_serve.part_ranges`: the parts tile the state exactly, and a huge tensor
is shared by several donors). The parts are read at once into one :class:`Assembly`; every
donor's epoch, layout and metadata must equal the first's. A part whose donor failed (an error,
a cut, another epoch, a donor that does not split) is asked again of the donors whose parts
arrived, one after another; the state is then checked as a whole (its digest agreed, the
caller's checks) by :func:`peer.swarm.state_download.download_state`, which falls back to one
donor at a time when the split download fails.
"""

from __future__ import annotations

import asyncio
import logging

from dht.errors import DHTError
from dht.net.transport import Transport
from peer.records.state import StateAnnouncement
from peer.swarm.state_receive import Assembly, Template, check_header, read_into
from peer.swarm.state_serve import part_ranges
from peer.swarm.state_sync import STREAM_NAME, StateSnapshot, StateSyncError

logger = logging.getLogger(__name__)


def split_donors(
    order: list[StateAnnouncement],
    agreed: dict[tuple[int, str], int],
    *,
    min_epoch: int,
    bf16: bool,
    max_donors: int,
) -> list[StateAnnouncement]:
    """Up to ``max_donors`` donors, in ``order``, that serve the same agreed state as the first
    donor to try (the download's own choice: :func:`peer.swarm.state_download.donor_order`),
    of ``min_epoch`` or later; [] when fewer than two do."""

    def key(donor: StateAnnouncement) -> tuple[int, str] | None:
        latest = donor.latest
        if donor.address is None or latest is None or latest.epoch != donor.epoch:
            return None
        digest = latest.digest_bf16 if bf16 else latest.digest
        return None if digest is None else (donor.epoch, digest)

    if not order or order[0].epoch < min_epoch or key(order[0]) not in agreed:
        return []
    group = [donor for donor in order if key(donor) == key(order[0])][:max_donors]
    return group if len(group) >= 2 else []


class _Parts:
    """The state being assembled from parts: the first reply's header decides the layout."""

    def __init__(self, template: Template, min_epoch: int, count: int):
        self.template = template
        self.min_epoch = min_epoch
        self.count = count
        self.header: tuple[int, list, object] | None = None
        self.assembly: Assembly | None = None
        self.num_bytes_by_donor: dict[str, int] = {}

    def adopt(self, header: object, index: int) -> Assembly:
        epoch, layout = check_header(header, self.min_epoch)
        if header.get("part") != [index, self.count]:
            raise StateSyncError("the donor did not send the part asked for")
        mine = (epoch, layout, header.get("metadata"))
        if self.header is None:
            self.assembly = Assembly.allocate(self.template, layout)
            self.header = mine
        elif mine != self.header:
            raise StateSyncError(f"the donor serves another state (epoch {epoch})")
        return self.assembly

    async def fetch(self, transport: Transport, donor: StateAnnouncement, index: int) -> None:
        """Read part ``index`` from ``donor`` into the assembly."""
        request = self.template.request(self.min_epoch, (index, self.count))
        async with transport.open_stream(donor.address, STREAM_NAME, request) as stream:
            await stream.finish_sending()
            assembly = self.adopt(await stream.reply_header(), index)
            ranges = part_ranges(assembly.wire_sizes(), index, self.count)
            for tensor_index, start, end in ranges:
                view = assembly.views[tensor_index][start:end]
                await read_into(stream, view, assembly.names[tensor_index])
            if await stream.recv() is not None:
                raise StateSyncError("more state bytes than the part holds")
        received = sum(end - start for _, start, end in ranges)
        self.num_bytes_by_donor[donor.peer_id] = (
            self.num_bytes_by_donor.get(donor.peer_id, 0) + received
        )


async def download_split(
    transport: Transport,
    donors: list[StateAnnouncement],
    *,
    min_epoch: int,
    template: Template,
) -> StateSnapshot:
    """The state of ``min_epoch`` or later, one part from each of ``donors`` (at least two),
    not checked against its digest yet.

    Raises:
        StateSyncError: a part that no donor delivered (each failure named).
    """
    parts = _Parts(template, min_epoch, len(donors))
    results = await asyncio.gather(
        *(parts.fetch(transport, donor, index) for index, donor in enumerate(donors)),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # a cancellation is never swallowed
    good = [d for d, r in zip(donors, results, strict=True) if r is None]
    reasons = [f"{d.address}: {_reason(r)}" for d, r in zip(donors, results, strict=True) if r]
    for index, result in enumerate(results):
        if result is None:
            continue
        logger.info("part %d of the state failed (%s); asking the other donors", index, result)
        for donor in good:  # fewer donors: the ones whose parts arrived
            try:
                await parts.fetch(transport, donor, index)
                break
            except (DHTError, StateSyncError, TimeoutError, ValueError, TypeError) as e:
                reasons.append(f"{donor.address}: {_reason(e)}")
        else:
            raise StateSyncError("a part of the state failed: " + "; ".join(reasons))
    epoch, _, metadata = parts.header
    logger.debug("state parts by donor (bytes): %s", parts.num_bytes_by_donor)
    return await parts.assembly.finish(epoch, metadata)


def _reason(error: BaseException | None) -> str:
    return (str(error) or type(error).__name__)[:200]
