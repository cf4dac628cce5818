"""A download's first step: ask the donors to digest their newest state now, and wait (briefly)
until a state that new is agreed.

Donors that hash only some of their epochs (:mod:`peer.swarm.digest_schedule`) announce digests
up to ``max_digest_gap_s`` of epochs old. A newcomer that took the newest agreed state then
arrived that far behind a swarm of fast epochs and spent its first rounds alone
(``tests/peer/run/test_newcomer_fast_epochs.py``), and a load right after a donor stopped got
the epoch before its last. So a download first asks up to ``NUM_ASKED`` donors to digest now
(``state.digest_now``, :class:`peer.swarm.state_sync.StateServer`); each answers with its newest
epoch, and the downloader reads the announcements again until a state at least as new as the
one ``required`` of them reached is agreed, ``AGREEMENT_READS`` reads at most.

An answer is a donor's claim, checked by nothing but the agreement: a donor that claims an epoch
it does not have only makes the downloader wait out its reads (seconds), and the download goes
on with whatever is agreed then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from pydantic import ValidationError

from dht.errors import DHTError
from dht.net.transport import Transport
from peer.records.schema import Count, WireModel
from peer.records.state import StateAnnouncement
from peer.swarm.state_agreement import AGREEMENT_READS, Agreement
from peer.swarm.state_sync import DIGEST_NOW_NAME, MIN_ANNOUNCE_GAP_S
from peer.swarm.state_sync_config import StateSyncConfig

logger = logging.getLogger(__name__)
# Donors asked to digest now (the first in the download's order). Every donor read, up to this:
# donors are tried most votes first, and one not asked still names its last digested epoch as
# its newest, which every peer voted for; more unasked donors than asked ones outvote the newest
# state and the download takes theirs (an older agreed state, as before donors were asked).
NUM_ASKED = 32


class DigestNowAnswer(WireModel):
    """A donor's answer to ``state.digest_now``: its newest epoch (None: no state yet)."""

    epoch: Count | None = None


async def fresh_agreement(
    transport: Transport,
    donors: Sequence[StateAnnouncement],
    agreement: Agreement,
    config: StateSyncConfig,
    read: Callable[[], Awaitable[Agreement]],
) -> Agreement:
    """``agreement``, or one read again once the newest state of the donors asked is agreed
    (``read`` reads it).

    Args:
        transport: the downloader's transport.
        donors: the donors to ask, in the download's order (the first ``NUM_ASKED`` with an
            address are asked).
        agreement: the agreement read before.
        config: ``request_timeout_s`` bounds each request.
        read: reads the agreement again.
    """
    asked = [d for d in donors if d.address is not None][:NUM_ASKED]
    answers = await asyncio.gather(*(_ask(transport, d, config.request_timeout_s) for d in asked))
    epochs = sorted((e for e in answers if e is not None), reverse=True)
    if len(epochs) < agreement.required:
        return agreement  # too few to agree on a newer state than the one read
    target = epochs[agreement.required - 1]
    for attempt in range(AGREEMENT_READS):
        if agreement.newest_epoch >= target:
            break
        await asyncio.sleep(MIN_ANNOUNCE_GAP_S * 2**attempt)
        agreement = await read()
    logger.debug(
        "asked %d donors to digest now: %d answered, epoch %d wanted, %d agreed",
        len(asked),
        len(epochs),
        target,
        agreement.newest_epoch,
    )
    return agreement


async def _ask(transport: Transport, donor: StateAnnouncement, timeout_s: float) -> int | None:
    """The newest epoch ``donor`` says it has digested now (None: no usable answer)."""
    try:
        answer = await transport.call(
            donor.address,
            DIGEST_NOW_NAME,
            {},
            timeout_s=timeout_s,
            expected_peer=donor.peer_id,
        )
    except (DHTError, TimeoutError) as e:  # an older donor, or a gone one
        logger.debug("asking %s to digest now: %s", donor.peer_id[:8], e)
        return None
    try:
        return DigestNowAnswer.model_validate(answer).epoch
    except ValidationError:
        logger.debug("a malformed answer to digest now from %s", donor.peer_id[:8])
        return None
