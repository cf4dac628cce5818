"""The downloader's side of state sync: find donors, download, and accept only a verified state.

A downloader reads every announcement (:mod:`peer.records.state`), and the digests that at least
``min_agreement`` distinct peers announce for an epoch (fewer only when fewer peers announce at
all: a lone donor is all a newcomer to a swarm of one has: :mod:`peer.swarm.state_agreement`),
asks its first donors to digest their newest state now and waits a moment for it to be agreed
(:mod:`peer.swarm.state_fresh`). It tries donors whose current state
is such an agreed digest first (newest epoch first, at random within an epoch, so that newcomers
spread over donors), then the others. When several donors serve the same agreed state, it first
downloads one part from each of up to ``max_split_donors`` of them at once
(:mod:`peer.swarm.state_split`), and falls back to one donor at a time when that fails. From
each it reads every tensor into fresh buffers (:mod:`peer.swarm.state_receive`),
checking each against the layout it expects (a donor cannot make it allocate more), then
computes the digest of what arrived itself and accepts the state only if that digest is agreed
for the state's epoch, and the caller's checks pass (finite values, typed metadata:
:mod:`peer.swarm.state_check`). Every failure is a typed error, logged, and the next donor is
tried after a backoff; the caller's model is never half-loaded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Collection

from dht.errors import DHTError
from dht.kademlia.node import DHTNode
from dht.net.transport import Transport
from peer.records.state import StateAnnouncement
from peer.swarm.state_agreement import AGREEMENT_READS, Agreement, Reach, read_agreement
from peer.swarm.state_fresh import fresh_agreement
from peer.swarm.state_receive import (
    Assembly,
    Layout,
    NotServedYet,
    Template,
    check_header,
    layout_of,
    read_into,
)
from peer.swarm.state_split import download_split, split_donors
from peer.swarm.state_sync import (
    MIN_ANNOUNCE_GAP_S,
    STREAM_NAME,
    DigestFn,
    StateRejected,
    StateSnapshot,
    StateSyncError,
    default_digest,
)
from peer.swarm.state_sync_config import StateSyncConfig

logger = logging.getLogger(__name__)
Verify = Callable[[StateSnapshot], None]
# What a download may raise because of a donor (its bytes, its answers, its silence).
DOWNLOAD_ERRORS = (
    DHTError,
    StateSyncError,
    TimeoutError,
    ValueError,
    TypeError,
    KeyError,
    RuntimeError,
    RecursionError,
)
__all__ = ["Layout", "download_state", "layout_of"]


def donor_order(
    agreement: Agreement,
    *,
    min_epoch: int,
    bf16: bool,
    rng: random.Random,
    only: Collection[str] | None = None,
) -> list[StateAnnouncement]:
    """Donors to try: those serving an agreed state of ``min_epoch`` or later first (the state
    most peers announce first, then the newest), then others at ``min_epoch`` or later (their
    digest may be on its way), then those serving a state only a partner vouches for (a last
    resort: one partner's word against peers whose digest may be a moment away), then the
    rest; at random within each. ``only``: just these peers."""
    donors = [
        a
        for a in agreement.announcements
        if a.address is not None and (only is None or a.peer_id in only)
    ]
    rng.shuffle(donors)

    def priority(donor: StateAnnouncement) -> tuple[int, int, int]:
        latest = donor.latest
        digest = None if latest is None else (latest.digest_bf16 if bf16 else latest.digest)
        votes, vouched = 0, False
        if latest is not None and latest.epoch == donor.epoch and digest is not None:
            votes = agreement.agreed.get((donor.epoch, digest), 0)
            vouched = (donor.epoch, digest) in agreement.vouched
        if donor.epoch < min_epoch:
            return (3, 0, -donor.epoch)
        return (0 if votes else 2 if vouched else 1, -votes, -donor.epoch)

    return sorted(donors, key=priority)


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
    digest_of: DigestFn = default_digest,
    verify: Verify | None = None,
    donors: Collection[str] | None = None,
    wait_s: float = 0.0,
    num_peers: float = 1.0,
    wait_for_epoch: int | None = None,
    partners: frozenset[str] = frozenset(),
) -> StateSnapshot:
    """Download a verified state of ``min_epoch`` or later, trying donors in turn.

    Each tensor named in ``expected`` must arrive with exactly the expected dtype and shape.
    Other tensors (e.g. optimizer moments that a fresh optimizer does not have yet) are accepted
    only under ``extra_prefix`` and up to ``max_extra_bytes`` in all; without ``extra_prefix``
    only the expected tensors are asked for. The state's digest (``digest_of``, computed here
    from what arrived) must be agreed for its epoch, and ``verify`` (if given) must not raise.
    ``donors``: download only from these peers (their digest still has to be agreed).
    ``wait_s``: while every donor tried serves only older states (it announces a new epoch's
    state a moment after entering it), read the announcements and try again for this long.
    ``num_peers``: the swarm's size as this peer counts it (which announcements to read).
    ``wait_for_epoch``: wait (up to ``wait_s``) for a state of this later epoch first, then take
    one of ``min_epoch`` or later (with rounds in the background, donors serve the state of
    their epoch once the round before it lands).
    ``partners``: the peers this one averaged with lately; a digest one of them announces is
    accepted for an epoch past every agreed one (``state_agreement.partner_vouched``).

    Raises:
        StateSyncError: no donor, or ``max_attempts`` donors failed (each one's reason in it);
            :class:`NotServedYet` when none had a state of ``min_epoch`` within ``wait_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    wanted = max(min_epoch, wait_for_epoch if wait_for_epoch is not None else min_epoch)
    while True:
        try:
            return await _download_once(
                transport,
                dht,
                prefix,
                min_epoch=wanted,
                template=functools.partial(
                    Template, expected, extra_prefix, max_extra_bytes, config.compression == "bf16"
                ),
                config=config,
                rng=rng or random.Random(),
                digest_of=digest_of,
                verify=verify,
                donors=donors,
                reach=Reach(num_peers, frozenset(donors or ()) | partners),
                partners=partners,
            )
        except NotServedYet as e:
            if loop.time() + MIN_ANNOUNCE_GAP_S > deadline:
                if wanted == min_epoch:
                    raise
                wanted = min_epoch  # waited long enough: any state of min_epoch or later
                continue
            logger.debug("no donor serves epoch %d yet (%s); trying again", wanted, e)
            await asyncio.sleep(MIN_ANNOUNCE_GAP_S)


async def _download_once(
    transport: Transport,
    dht: DHTNode,
    prefix: str,
    *,
    min_epoch: int,
    template: Callable[[], Template],
    config: StateSyncConfig,
    rng: random.Random,
    digest_of: DigestFn,
    verify: Verify | None,
    donors: Collection[str] | None,
    reach: Reach,
    partners: frozenset[str],
) -> StateSnapshot:
    """One pass of :func:`download_state` over the donors (``template``: a fresh one for each
    download, which counts the bytes allocated)."""
    bf16 = config.compression == "bf16"
    read = functools.partial(read_agreement, dht, prefix, config, reach, partners)
    agreement = await read()
    order = donor_order(agreement, min_epoch=min_epoch, bf16=bf16, rng=rng, only=donors)
    # donors that digest only some epochs: the newest agreed state may be seconds old
    agreement = await fresh_agreement(
        transport,
        order,
        agreement,
        config,
        read,
    )
    order = donor_order(agreement, min_epoch=min_epoch, bf16=bf16, rng=rng, only=donors)
    if not order:
        raise StateSyncError(f"no peer serves state of epoch >= {min_epoch}")

    async def verified(fetch: Callable[[Template], Awaitable[StateSnapshot]]) -> StateSnapshot:
        nonlocal agreement
        async with asyncio.timeout(config.download_timeout_s):
            snapshot = await fetch(template())
            agreement = await _check_digest(snapshot, read, agreement, digest_of, bf16)
            if verify is not None:
                await asyncio.to_thread(verify, snapshot)
        return snapshot

    group = split_donors(
        order, agreement.agreed, min_epoch=min_epoch, bf16=bf16, max_donors=config.max_split_donors
    )
    reasons, not_yet = [], True
    if len(group) >= 2:
        try:
            snapshot = await verified(
                lambda template: download_split(
                    transport, group, min_epoch=min_epoch, template=template
                )
            )
            logger.info("downloaded state of epoch %d from %d donors", snapshot.epoch, len(group))
            return snapshot
        except DOWNLOAD_ERRORS as e:
            reasons.append(f"{len(group)} donors at once: {_reason(e)}")
            not_yet = not_yet and isinstance(e, NotServedYet)
            logger.warning("state download from %d donors failed: %s", len(group), _reason(e))
    for attempt, donor in enumerate(order[: config.max_attempts]):
        if attempt:
            await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1))
        address = donor.address
        try:
            snapshot = await verified(
                functools.partial(_download_from, transport, address, min_epoch)
            )
            logger.info("downloaded state of epoch %d from %s", snapshot.epoch, address)
            return snapshot
        except DOWNLOAD_ERRORS as e:
            reasons.append(f"{address}: {_reason(e)}")
            not_yet = not_yet and isinstance(e, NotServedYet)
            # a donor a moment behind is no fault of its own: said quietly
            level = logging.DEBUG if isinstance(e, NotServedYet) else logging.WARNING
            logger.log(level, "state download from %s failed: %s", address, _reason(e))
    error = NotServedYet if not_yet else StateSyncError
    raise error("every donor failed: " + "; ".join(reasons))


def _reason(error: BaseException) -> str:
    if isinstance(error, (DHTError, StateSyncError, TimeoutError)):
        return str(error) or type(error).__name__
    # what a donor's bytes made a check or a conversion raise: that donor's fault
    return f"{type(error).__name__}: {str(error)[:200]}"


async def _check_digest(
    snapshot: StateSnapshot,
    read: Callable[[], Awaitable[Agreement]],
    agreement: Agreement,
    digest_of: DigestFn,
    bf16: bool,
) -> Agreement:
    """The agreement (read again with ``read`` if the state is newer than it), once
    ``snapshot``'s digest is in it; :class:`StateRejected` if it is not."""
    digest = await asyncio.to_thread(digest_of, snapshot, bf16)
    for attempt in range(AGREEMENT_READS):
        if agreement.accepts(snapshot.epoch, digest):
            break
        # the donor may have moved on since the read: peers announce a new epoch's digest
        # within a moment (MIN_ANNOUNCE_GAP_S, plus the time to compute it)
        await asyncio.sleep(MIN_ANNOUNCE_GAP_S * 2**attempt)
        agreement = await read()
    if not agreement.accepts(snapshot.epoch, digest):
        votes = sum(
            1
            for a in agreement.announcements
            for d in a.digests
            if d.epoch == snapshot.epoch and digest in (d.digest, d.digest_bf16)
        )
        raise StateRejected(
            f"the state of epoch {snapshot.epoch} has digest {digest[:12]}, which {votes} "
            f"peer(s) announce; {agreement.required} must"
        )
    if (snapshot.epoch, digest) not in agreement.agreed:
        logger.info(
            "the state of epoch %d (digest %s) is vouched for by a partner alone: no digest of "
            "that epoch or a later one has %d voters",
            snapshot.epoch,
            digest[:12],
            agreement.required,
        )
    return agreement


async def _download_from(
    transport: Transport, address: str, min_epoch: int, template: Template
) -> StateSnapshot:
    async with transport.open_stream(address, STREAM_NAME, template.request(min_epoch)) as stream:
        await stream.finish_sending()
        header = await stream.reply_header()
        epoch, layout = check_header(header, min_epoch)
        assembly = Assembly.allocate(template, layout)
        for name, view in zip(assembly.names, assembly.views, strict=True):
            await read_into(stream, view, name)
        if await stream.recv() is not None:
            raise StateSyncError("more state bytes than the header announced")
    return await assembly.finish(epoch, header.get("metadata"))
