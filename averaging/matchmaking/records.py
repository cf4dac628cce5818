"""What one search reads and writes: its announcement in the DHT, the candidates read back, the
join request it sends, and its check of the group a leader offers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from averaging.config import AveragerConfig
from averaging.matchmaking.group import GroupInfo, check_offered
from averaging.matchmaking.search import Candidate, MatchmakingDHT, Search, parse_candidates
from dht.config import get_dht_time
from dht.errors import DHTError
from dht.kademlia.validation import owner_subkey

logger = logging.getLogger(__name__)

_RECORD_SLACK_S = 1.0
_READ_SLACK_S = 1.0


async def announce(dht: MatchmakingDHT, search: Search, config: AveragerConfig) -> None:
    """Store this peer's announcement under the search's key, in a subkey only it can write
    (a failure is logged: others may then not find us).

    The store is bounded by ``request_timeout_s`` itself, so that the replicas that took the
    announcement by then count. A bound around the store cancelled it whole while one slow
    replica held it up: the announcement was on the others, and the peer logged it lost (the
    suite's loaded runs left three peers of one epoch alone that way).
    """
    loop = asyncio.get_running_loop()
    value = {"addr": search.me.address, "numel": search.numel, "settled": search.settled}
    expiration = get_dht_time() + (search.deadline - loop.time())
    subkey = owner_subkey(search.me.peer_id)
    start = loop.time()
    bound_s = config.request_timeout_s
    try:
        # the slack only guards the local work after the stores, which waits on nothing
        async with asyncio.timeout(bound_s + _RECORD_SLACK_S):
            stored = await dht.store(
                search.key,
                value,
                expiration + _RECORD_SLACK_S,
                subkey=subkey,
                replicas=config.store_replicas,
                timeout_s=bound_s,
            )
    except (TimeoutError, DHTError):
        stored = False
    if not stored:
        logger.info("could not announce %s for matchmaking; others may not find us", search.key)
    logger.debug("announced under %s in %.1f ms", search.key, 1000 * (loop.time() - start))


async def read_candidates(
    dht: MatchmakingDHT, search: Search, config: AveragerConfig, remaining_s: float
) -> list[Candidate]:
    """The other peers announced under the search's key (none if the read fails).

    The read's bound is the lookup's own: at it, the announcements of the replicas that
    answered count. A bound around the whole read threw them away, and on a busy host (64 light
    peers on 2 cores, every replica's answer a second late) nearly every read of a row's key
    ran out, so that peers looking at once under one key each found "no other peer".
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    bound_s = min(config.request_timeout_s, remaining_s)
    search.num_reads += 1
    try:
        # the slack only guards the merge after the lookup, which waits on nothing
        async with asyncio.timeout(bound_s + _READ_SLACK_S):
            outcome = await dht.get_outcome(
                search.key, latest=True, replicas=config.read_replicas, timeout_s=bound_s
            )
    except (TimeoutError, DHTError):
        search.num_failed_reads += 1
        search.num_reads_ended += 1
        search.slowest_read_s = max(search.slowest_read_s, loop.time() - start)
        return []
    search.num_reads_ended += 1
    found = outcome.value
    if outcome.num_queried and not outcome.num_answered:  # at most its own replica read
        search.num_failed_reads += 1
    candidates = parse_candidates(found, search.key, search.me.peer_id)
    read_s = loop.time() - start
    search.slowest_read_s = max(search.slowest_read_s, read_s)
    logger.debug(
        "read %d candidate(s) under %s in %.1f ms", len(candidates), search.key, 1e3 * read_s
    )
    return candidates


def join_request(search: Search) -> dict[str, Any]:
    """What a follower sends a leader to ask for a seat."""
    return {
        "key": search.key,
        "member": search.me.to_wire(),
        "numel": search.numel,
        "remaining_s": max(0.0, search.deadline - asyncio.get_running_loop().time()),
    }


def check_group(
    search: Search, group: GroupInfo, leader: Candidate, config: AveragerConfig
) -> None:
    """Refuse a group this peer cannot take part in honestly (see :func:`check_offered`).

    Raises:
        ProtocolViolation, KeyError: the group is refused.
    """
    check_offered(
        group,
        me=search.me,
        leader=(leader.peer_id, leader.address),
        max_size=max(search.target_group_size, config.target_group_size),
        aggregation=config.aggregation,
        max_weight_ratio=search.max_weight_ratio,
        numel=search.numel,
        max_streams=config.max_streams_per_pair,
        chunk_numel=config.chunk_numel,
        min_reducers=config.target_group_size,
    )
