"""Balanced rows: how many groups a round needs, how large each is, and where peers meet.

A caller that knows how many peers are ready (``N``, e.g. from the swarm's progress) asks for
groups of at most ``g`` (``target_group_size``). Rather than filling groups of ``g`` and leaving
the rest to chance (24 peers, ``g`` 16: 16 + 8), the round takes ``k = ceil(N / g)`` *rows* of
balanced sizes: a leader closes at ``ceil(N / k)`` members (24: 12 + 12), or, after a short
grace, at what the last row holds when the others took ``ceil(N / k)`` (25: 13 + 12 without
waiting for the matchmaking deadline); a row below that floor closes once nobody joined or was
newly seen for another grace (:meth:`averaging.matchmaking.search.Search.should_close`).
Leaders do not coordinate, but a peer in a formed group
tells whoever asks to join it which peers are in it (``full`` with ``formed``), so a later leader
balances its row over the peers left (10 peers, ``g`` 4: 4 + 3 + 3, not 4 + 4 + 2); a peer
that learns every other is taken goes to the top round at once as a row of one.

Discovery does not grow with ``N``: the matchmaking key is sharded into ``B`` buckets, ``B`` the
power of two nearest ``N / (2 g)`` (1 below about ``2.8 g`` peers), ``{key}.b{B}.{i}`` with
``i = sha256(seed, peer id) mod B``, so a read returns about ``2 g`` announcements, not ``N``.
The seed is the run's matchmaking key without the epoch: a peer meets the same bucket every
round (under a key that changes every round), so the rows of one round meet again at the next.
Drawn per epoch, buckets split each row over the next round's buckets, and partners (who follow
each other first: :mod:`averaging.matchmaking.matchmaker`) led a row of their own in each: 64
light peers formed 7 to 12 rows per round where 4 or 5 hold them, and the rows never merged.
``B`` is in the key: peers whose estimates of ``N`` differ never mix two bucket layouts under one
key. Peers whose estimates straddle an edge of the layout (``N / (2 g) = 2**(j + 1/2)``) meet
on different keys, so the edges sit as far as a power-of-two layout allows from where a swarm
of ``2**j`` groups' worth of peers estimates itself (``N // (2 g)``, with its first edge at
``4 g``, put 64 peers at ``g`` 16 on the edge, and 4 in 10 of 10,000 simulated peers on a layout
nobody else used). So the members of a whole round lay the next epoch's keys out for the count
that round reached, which they all hold, not for their own estimates
(:class:`averaging.rounds.LayoutMemory`). In a bucket, a peer sizes its row from the peers it
saw there (at least the ``N / B`` it expects).

The rows' means are then combined by the delegates of the rows (:mod:`averaging.levels`), whose
own search uses :class:`SizePlan` too (:meth:`RoundPlan.top_sizes`): one group that closes once
the delegates' counts sum to ``N`` (or to the last whole round's count, if larger), whatever
sizes the rows came out at.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

BUCKET_PEERS_PER_GROUP = 2  # a bucket holds about this many groups' worth of peers
MAX_ROWS = 256  # the most delegates in one group (averaging.matchmaking.group.MAX_GROUP_SIZE)
_BUCKETED = re.compile(r"\.b(\d+)\.\d+$")  # what bucket_key appends


def num_rows(num_peers: int, group_size: int) -> int:
    """Rows that hold ``num_peers`` in groups of at most ``group_size``."""
    return max(1, -(-num_peers // group_size))


def row_target(num_peers: int, group_size: int) -> int:
    """The balanced row size: ``ceil(N / ceil(N / g))``."""
    return max(1, -(-num_peers // num_rows(num_peers, group_size)))


def row_floor(num_peers: int, group_size: int) -> int:
    """The last row's size when every other row took the target: ``N - (k - 1) ceil(N / k)``
    (at most ``floor(N / k)``; equal to it when ``N mod k`` is 0 or ``k - 1``)."""
    rows = num_rows(num_peers, group_size)
    return max(1, num_peers - (rows - 1) * row_target(num_peers, group_size))


def num_buckets(num_peers: int, group_size: int) -> int:
    """How many keys the peers of one round are spread over (1 below about ``2.8 g`` peers)."""
    if num_peers <= 0:
        return 1
    return 2 ** max(0, round(math.log2(num_peers / (BUCKET_PEERS_PER_GROUP * group_size))))


def surely_in_bucket(expected: int) -> int:
    """Peers that a bucket expected to hold ``expected`` nearly always holds: two standard
    deviations below it (a bucket's count is binomial, about Poisson, around its share)."""
    return max(1, math.floor(expected - 2 * math.sqrt(expected)))


def bucket_of(key: str, peer_id: str, buckets: int) -> int:
    """The bucket of ``peer_id`` drawn from ``key`` (the same for everyone)."""
    digest = hashlib.sha256(key.encode() + b"/" + bytes.fromhex(peer_id)).digest()
    return int.from_bytes(digest[:8], "big") % buckets


def bucket_key(key: str, peer_id: str, buckets: int, seed: str = "") -> str:
    """The key under which ``peer_id`` looks for its row: ``key`` itself with one bucket; its
    bucket drawn from ``seed`` (``key`` when empty)."""
    if buckets <= 1:
        return key
    return f"{key}.b{buckets}.{bucket_of(seed or key, peer_id, buckets)}"


def key_buckets(key: str) -> int:
    """The buckets of the layout that ``key``, made by :func:`bucket_key`, belongs to."""
    found = _BUCKETED.search(key)
    return int(found.group(1)) if found else 1


def layout_split_fraction(layouts: Iterable[Mapping[int, int]]) -> float | None:
    """Of the searches counted per round (searches by their layout's buckets), those under a
    layout other than their round's most common one (None: no search)."""
    split = total = 0
    for counts in layouts:
        searches = sum(counts.values())
        split += searches - max(counts.values(), default=0)
        total += searches
    return round(split / total, 4) if total else None


@dataclass(frozen=True)
class SizePlan:
    """When a leader closes its group: at ``target`` members, or after ``grace_s`` with at least
    ``floor`` (and the config's minimum), or, for the delegates' search, once the members'
    counts reach ``expected_count``.

    Attributes:
        target: close as soon as the group has this many members.
        floor: after the grace, close with this many.
        grace_s: seconds from the start of the search after which ``floor`` is enough
            (``inf``: never).
        expected_in_key: peers expected under the search's key; 0 when ``target`` is fixed.
            Otherwise the target and floor follow the peers seen there and those known to be
            in other groups already (:meth:`resized`).
        group_size: the largest row (``g``), for :meth:`resized`.
        sharded: ``expected_in_key`` is an estimate (a bucket's share of ``N``): the floor
            follows the peers seen, but never below what a bucket nearly always holds
            (:func:`surely_in_bucket`: peers that start their round seconds apart on a busy
            host are not yet seen when the grace ends; following only the seen, leaders
            closed rows of 2 to 7 where 32 peers were expected).
        num_left: peers of the key not known to be in another group, this one included (0:
            unknown). 1 after the grace: this peer is the last, it need not wait for a row.
        wait_for_seen: close only once every peer seen under the key is in (the delegates'
            search: a row left out would end the round with a second model).
        expected_count: the delegates' search: close once the members' counts (the peers each
            one's contribution stands for) sum to this (``N``); 0: no such rule.
        quiet_s: past the grace, close at the floor only once no peer arrived or was first
            seen for this long, counted from the end of the grace at the earliest (the
            delegates' search: ``top_quiet_s``; the last rows come after the grace).
    """

    target: int
    floor: int = 0
    grace_s: float = math.inf
    expected_in_key: int = 0
    group_size: int = 0
    sharded: bool = False
    num_left: int = 0
    wait_for_seen: bool = False
    expected_count: int = 0
    quiet_s: float = 0.0

    def resized(self, num_seen: int, num_taken: int = 0) -> SizePlan:
        """The plan once ``num_seen`` peers (this one included) were seen under the key, of
        which ``num_taken`` are known to be in other groups: rows are balanced over the peers
        left (at least the expected count, less those taken), the floor from what is known to
        be there (the expected count, or, with a sharded key, what was seen); waiting for
        everyone seen, the target and floor are at least ``num_seen``."""
        if self.wait_for_seen:
            seen = min(num_seen, MAX_ROWS)
            return dataclasses.replace(
                self, target=max(self.target, seen), floor=max(self.floor, seen)
            )
        if not self.expected_in_key:
            return self
        g = self.group_size
        if self.sharded:
            known = max(num_seen, surely_in_bucket(self.expected_in_key))
        else:
            known = max(num_seen, self.expected_in_key)
        num_left = max(1, known - num_taken)
        target = row_target(max(1, max(num_seen, self.expected_in_key) - num_taken), g)
        return dataclasses.replace(
            self,
            target=max(2, target),
            floor=row_floor(num_left, g),
            num_left=num_left,
        )


@dataclass(frozen=True)
class RoundPlan:
    """How one round of ``num_peers`` ready peers in groups of at most ``group_size`` goes.

    Attributes:
        num_peers: ready peers (``N``), this one included.
        group_size: the largest row (``g``).
        buckets: keys the rows are found under (:func:`num_buckets`).
        grace_s: a leader's grace (``AveragerConfig.row_grace_s``).
        whole_peers: peers the last whole round reached (0: unknown), the count the keys are
            laid out for (:class:`averaging.rounds.LayoutMemory`); the delegates' search waits
            for at least this many (:meth:`top_sizes`), and a round takes two levels when it
            is more than a group (:attr:`single`). The rows follow the estimate.
    """

    num_peers: int
    group_size: int
    buckets: int
    grace_s: float
    whole_peers: int = 0

    @classmethod
    def of(
        cls, num_peers: int, group_size: int, grace_s: float, layout_peers: int | None = None
    ) -> RoundPlan:
        """The plan for ``num_peers``, its keys laid out for ``layout_peers`` when given (a
        count the round's peers share, where their own estimates differ)."""
        buckets = num_buckets(layout_peers or num_peers, group_size)
        return cls(num_peers, group_size, buckets, grace_s, layout_peers or 0)

    @property
    def planned_peers(self) -> int:
        """The peers the round plans its levels for: the estimate, or the last whole round's
        count where that is larger (an estimate lags low where epochs are short)."""
        return max(self.num_peers, self.whole_peers)

    @property
    def single(self) -> bool:
        """One group holds every peer: no second level. Not when the last whole round reached
        more than a group holds (``whole_peers``), whatever the estimate says: an estimate
        that lags the swarm (records of peers outside this peer's row, one epoch old at the
        boundary) made each row of 32 peers close as a group of its own, two models, every
        epoch (the 32-peer ``peer join`` run, 2026-11-28)."""
        return self.planned_peers <= self.group_size

    @property
    def num_rows(self) -> int:
        """The rows this plan expects: per bucket, enough rows for its share of
        :attr:`planned_peers`."""
        per_bucket = -(-self.planned_peers // self.buckets)
        return self.buckets * num_rows(per_bucket, self.group_size)

    def row_sizes(self) -> SizePlan:
        """The row search's sizes, followed by what it sees under its key and learns of the
        groups already formed there (:meth:`SizePlan.resized`)."""
        sharded = self.buckets > 1
        expected = self.num_peers // self.buckets if sharded else self.num_peers
        g = self.group_size
        plan = SizePlan(row_target(expected, g), row_floor(expected, g), self.grace_s, expected, g)
        # a sharded key's plan follows what its first read sees; the whole key's is known
        return dataclasses.replace(plan, sharded=True) if sharded else plan.resized(1)

    def top_sizes(self, quiet_s: float) -> SizePlan:
        """The delegates' search: one group, closed once the delegates' counts sum to ``N``
        (every row is in), or past the grace once every delegate seen is in and none arrived
        for ``quiet_s`` (an estimate of ``N`` too high, a row lost), or at the deadline.

        ``N`` is the estimate or the last whole round's count, whichever is larger. A count
        closed at an estimate below the truth leaves the rows that come later to a second top
        group, a second model: at 64 busy peers the estimates were 55-58, and 7 of 12 epochs
        ended with two means. The peers of a whole round are nearly all back at the next; if
        some are not, the search closes past the grace as for an estimate too high."""
        return SizePlan(
            MAX_ROWS,
            2,
            self.grace_s,
            wait_for_seen=True,
            expected_count=self.planned_peers,
            quiet_s=quiet_s,
        )
