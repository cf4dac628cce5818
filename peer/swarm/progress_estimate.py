"""The swarm's progress as one peer estimates it, from the progress records it read.

From the records (:mod:`peer.records.progress`) a peer estimates the swarm's epoch, how many
samples the swarm has accumulated toward ``target_batch_size`` in that epoch, and the ETA to it,
so that matchmaking can start just in time.

The records are every peer's (a small swarm: the tracker read every bucket of a layout of at most
``max_whole_buckets``) or a **sample** (:class:`Sample`: a larger swarm, some or all of its
buckets). In a sample, the peers read for their
own sake (this one, its partners) count once each and the others stand for the peers not read:
each counts ``(N - known) / others seen`` times, ``N`` the swarm's estimated size.

A record is a claim, so a minority of peers (or one stranger with a fresh key) must not steer it:

* Records pass the schema of :mod:`peer.records.progress` (typed, ranged; the rest is dropped).
* **Partners**: the peers this one averaged with in its last ``trust_rounds`` rounds. In a small
  swarm (every record read), while any partner has a record, only the partners' samples count
  toward the target: a stranger's "target reached" record does not end an honest epoch early. A
  peer with no partner yet (a newcomer, the first epoch) counts every record, since it has
  nothing better.
  In a sample, the partners cannot stand for a swarm many times their number, so the other
  peers count too, but a stranger's samples count at most ``max_stranger_claim_ratio`` times
  the partners' mean (or, with no partner at the epoch, the median of the peers at it): one
  stranger moves the estimate by at most that many peers' worth times its weight.
* The swarm's epoch moves ahead of this peer's when at least two partners (or the only one) are
  there (a record that announces an arrival ahead of its download does not count:
  :mod:`peer.swarm.arrival`), or a strict majority of the other peers seen is, or (a swarm split
  in two: peers that started apart, a partition that healed) a third of them is at least two
  epochs ahead. Rounds form among peers at one epoch, so nothing else would ever merge two
  groups of peers that run at different epochs; a third, not a majority, because the group ahead
  may well be the smaller one (the first peers of a run, which trained before the others came);
  at least three of them, so that two fresh keys in a small swarm do not (a split of two ahead
  stays split).
* Rates count at most ``max_rate_ratio`` times the median rate of the peers counted; a partner
  that left the last round with this peer cannot claim more samples than its rate allows over
  the time since that round ended (plus ``epoch_skew_s``); no record counts beyond the target.
* Clock skew is tolerated: records are extrapolated by at most ``max_extrapolation_s``, and a
  negative age (a peer whose clock runs ahead) counts as zero.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from peer.records.progress import PeerProgress
from peer.swarm.progress_config import ProgressConfig


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm as one peer estimates it.

    ``peers``: this one first, then every other peer seen (the records read: a sample of a
    large swarm); only the counted ones are in ``samples_accumulated`` and ``samples_per_s``.
    ``weights``: how many peers each of ``peers`` stands for (empty: one each, every record
    was read); ``num_peers`` and ``num_clients`` are the swarm's, estimated the same way.
    """

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    samples_per_s: float
    eta_next_epoch_s: float
    num_peers: int
    num_clients: int
    peers: tuple[PeerProgress, ...]
    weights: tuple[float, ...] = ()

    @property
    def ready(self) -> bool:
        """Whether the swarm has (by this estimate) reached the target of its epoch."""
        return self.samples_accumulated >= self.target_batch_size

    def num_at(self, epoch: int) -> int:
        """How many peers of the swarm are at ``epoch``, estimated (this one included)."""
        weights = self.weights or (1.0,) * len(self.peers)
        count = sum(w for p, w in zip(self.peers, weights, strict=True) if p.epoch == epoch)
        return round(count)


@dataclass(frozen=True)
class Sample:
    """The records read are a sample of a larger swarm (see the module docstring).

    Attributes:
        known: the peers whose buckets were read for their own sake (this one, partners):
            each record of theirs counts once.
        num_peers: the swarm's estimated size, this peer included.
    """

    known: frozenset[str]
    num_peers: float


def _after_round(
    record: PeerProgress, round_peers: dict[str, tuple[int, float]] | None
) -> PeerProgress:
    entered = (round_peers or {}).get(record.peer_id)
    if entered is None or record.epoch >= entered[0]:
        return record
    epoch, round_end = entered
    return PeerProgress(
        record.peer_id,
        epoch,
        0,
        record.samples_per_s,
        round_end,
        record.address,
        record.client_mode,
    )


# A split swarm merges forward when a third of the others, and at least this many of them (two
# strangers' fresh keys move nothing), are SPLIT_MIN_GAP epochs ahead or more (one epoch ahead is
# only a group whose round ended first).
SPLIT_MIN_AHEAD = 3
SPLIT_MIN_GAP = 2


def _swarm_epoch(own_epoch: int, others: list[PeerProgress], partners: list[PeerProgress]) -> int:
    """The newest epoch ahead of ``own_epoch`` that two partners (or the only one), a strict
    majority of the other peers, or a third of them two or more epochs ahead have reached;
    ``own_epoch`` if none (O(n log n): thousands of records cost no more than sorting them)."""
    candidates = [own_epoch]
    newest = sorted((r.epoch for r in others), reverse=True)
    if newest:  # the (n // 2 + 1)-th newest epoch: a strict majority is there or beyond
        candidates.append(newest[len(newest) // 2])
    quorum = max(SPLIT_MIN_AHEAD, math.ceil(len(newest) / 3))
    if len(newest) >= quorum and newest[quorum - 1] >= own_epoch + SPLIT_MIN_GAP:
        candidates.append(newest[quorum - 1])  # a third of the others is there or beyond
    if partners:  # the second newest of the partners' epochs (the newest, if only one)
        quorum = min(2, len(partners))
        candidates.append(sorted((r.epoch for r in partners), reverse=True)[quorum - 1])
    return max(candidates)


def _rate_cap(rates: Iterable[float], config: ProgressConfig) -> float:
    positive = [rate for rate in rates if rate > 0]
    if not positive:
        return config.max_samples_per_s
    return min(config.max_samples_per_s, config.max_rate_ratio * statistics.median(positive))


def estimate(
    records: list[PeerProgress],
    *,
    own: PeerProgress,
    config: ProgressConfig,
    now: float,
    round_peers: dict[str, tuple[int, float]] | None = None,
    partners: frozenset[str] = frozenset(),
    sample: Sample | None = None,
    round_reach: tuple[int, int] | None = None,
) -> GlobalProgress:
    """The swarm's epoch, samples toward the target, rate and ETA, from ``records`` and ``own``.

    ``round_peers`` maps the peers of this peer's last round to (the epoch they entered, the
    DHT time the round ended): a record older than that round is read as that peer starting
    the new epoch at the round's end, which keeps fast epochs (shorter than the publishing
    interval) in step. ``partners`` are the peers trusted to count (see the module docstring).
    ``sample``: the records are a sample of the swarm (None: every peer's).
    ``round_reach``: (the epoch entered, the peers reached) by this peer's last round, when
    that round reached more peers than its own group (rows and a top round; see
    :func:`_stand_for`).
    Never raises: every record passed the schema, so every number is bounded.
    """
    round_peers = round_peers or {}
    others = [_after_round(r, round_peers) for r in records if r.peer_id != own.peer_id]
    trusted = [r for r in others if r.peer_id in partners]
    # an arrival is a promise, not a position: counted as a position, the records of peers
    # arriving one epoch ahead pulled their partners into arriving further ahead, and 32 `peer
    # join` peers announced epochs up to 25 while none had passed 12
    there = [r for r in others if not r.arriving]
    epoch = _swarm_epoch(own.epoch, there, [r for r in there if r.peer_id in partners])
    if sample is not None:
        return _sampled(others, trusted, own, epoch, config, now, round_peers, sample)
    counted = trusted or others  # no partner here: a newcomer counts everyone it sees
    target = config.target_batch_size
    rate_cap = _rate_cap((r.samples_per_s for r in [own, *counted] if r.epoch == epoch), config)
    counted = [_capped_rate(r, rate_cap) for r in counted]
    accumulated = float(own.samples) if own.epoch == epoch else 0.0
    for record in counted:
        if record.epoch == epoch:
            accumulated += _claimed(record, now, config, round_peers.get(record.peer_id))
    accumulated = min(accumulated, float(target * (1 + len(counted))))
    rate = own.samples_per_s + sum(record.samples_per_s for record in counted)
    scale = _stand_for(round_reach, epoch, own, counted, others)
    accumulated, rate = accumulated * scale, rate * scale
    # every peer seen, counted or not: who is at this epoch sizes groups (seats for newcomers;
    # partners keep theirs, see averaging.matchmaking.leader) and tells a peer whether it is alone
    counted_ids = {r.peer_id for r in counted}
    peers = [
        own,
        *counted,
        *(_capped_rate(r, rate_cap) for r in others if r.peer_id not in counted_ids),
    ]
    return _progress(epoch, accumulated, rate, config, peers, ())


def _stand_for(
    round_reach: tuple[int, int] | None,
    epoch: int,
    own: PeerProgress,
    counted: list[PeerProgress],
    others: list[PeerProgress],
) -> float:
    """How many peers each one counted at ``epoch`` stands for: the peers this peer's last round
    reached over those counted there (this one and its partners), when that round entered
    ``epoch`` and reached more (1 otherwise).

    Only partners count in a swarm read whole, and a peer's partners are its row: after a round
    of rows and a top round, each row reached the target on its own samples, and the rows met
    at the top once the slowest had. 32 ``peer join`` peers in rows of 16 + 12 + 4 trained
    28,600-34,800 samples per epoch for a target of 8,192. The others' records are not counted
    (they may be a stranger's), but the partners stand for them, as a sample stands for the
    swarm. The count comes from the top round (the rows' delegates' counts); it is bounded by
    the peers whose records were read, so a count claimed high by one delegate moves nothing
    unless as many records back it."""
    if round_reach is None or round_reach[0] != epoch or own.epoch != epoch:
        return 1.0
    here = 1 + sum(1 for r in counted if r.epoch == epoch)
    return max(1.0, min(round_reach[1], 1 + len(others)) / here)


def _progress(
    epoch: int,
    accumulated: float,
    rate: float,
    config: ProgressConfig,
    peers: list[PeerProgress],
    weights: tuple[float, ...],
) -> GlobalProgress:
    missing = max(0.0, config.target_batch_size - accumulated)
    eta_s = 0.0 if not missing else (missing / rate if rate > 0 else math.inf)
    each = weights or (1.0,) * len(peers)
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=int(accumulated),
        target_batch_size=config.target_batch_size,
        samples_per_s=rate,
        eta_next_epoch_s=eta_s,
        num_peers=max(1, round(sum(each))),
        num_clients=round(sum(w for r, w in zip(peers, each, strict=True) if r.client_mode)),
        peers=tuple(peers),
        weights=weights,
    )


def _sampled(
    others: list[PeerProgress],
    trusted: list[PeerProgress],
    own: PeerProgress,
    epoch: int,
    config: ProgressConfig,
    now: float,
    round_peers: dict[str, tuple[int, float]],
    sample: Sample,
) -> GlobalProgress:
    """:func:`estimate` from a sample: the known peers once, the others scaled up to the
    swarm's estimated size, a stranger's claim bounded by the trusted ones'."""
    counted = trusted or others
    rate_cap = _rate_cap((r.samples_per_s for r in [own, *counted] if r.epoch == epoch), config)
    others = [_capped_rate(r, rate_cap) for r in others]
    known = [r for r in others if r.peer_id in sample.known]
    drawn = [r for r in others if r.peer_id not in sample.known]
    # the drawn stand for every peer not known: at least themselves
    weight = max(1.0, (sample.num_peers - 1 - len(known)) / len(drawn)) if drawn else 0.0
    claims = {  # each record's samples toward the epoch (0 at another epoch)
        r.peer_id: _claimed(r, now, config, round_peers.get(r.peer_id)) if r.epoch == epoch else 0.0
        for r in others
    }
    trusted_ids = {r.peer_id for r in trusted}
    own_claim = float(own.samples) if own.epoch == epoch else 0.0
    bound = config.max_stranger_claim_ratio * _reference_claim(
        own_claim if own.epoch == epoch else None,
        [claims[r.peer_id] for r in trusted if r.epoch == epoch],
        [claims[r.peer_id] for r in others if r.epoch == epoch],
    )
    accumulated = own_claim + sum(claims[r.peer_id] for r in known)
    accumulated += weight * sum(
        claims[r.peer_id] if r.peer_id in trusted_ids else min(claims[r.peer_id], bound)
        for r in drawn
    )
    rate = own.samples_per_s + sum(r.samples_per_s for r in known)
    rate += weight * sum(r.samples_per_s for r in drawn)
    accumulated = min(accumulated, config.target_batch_size * max(1.0, sample.num_peers))
    weights = (1.0, *(1.0 for _ in known), *(weight for _ in drawn))
    return _progress(epoch, accumulated, rate, config, [own, *known, *drawn], weights)


def _reference_claim(own: float | None, trusted: list[float], everyone: list[float]) -> float:
    """What one honest peer has accumulated at the epoch, by the peers trusted most: the mean
    of this one's and its partners' claims, or with no partner there, the median of all."""
    mine = [] if own is None else [own]
    if trusted:
        return statistics.fmean([*mine, *trusted])
    claims = [*mine, *everyone]
    return statistics.median(claims) if claims else 0.0


def _capped_rate(record: PeerProgress, rate_cap: float) -> PeerProgress:
    if record.samples_per_s <= rate_cap:
        return record
    return dataclasses.replace(record, samples_per_s=rate_cap)


def _claimed(
    record: PeerProgress,
    now: float,
    config: ProgressConfig,
    entered: tuple[int, float] | None,
) -> float:
    """The samples ``record`` counts for now: extrapolated by its rate (bounded in time), no
    more than the target, and for a partner that entered this epoch at the end of this peer's
    last round, no more than its rate allows since then."""
    age_s = min(max(now - record.time, 0.0), config.max_extrapolation_s)
    claimed = min(record.samples + record.samples_per_s * age_s, float(config.target_batch_size))
    if entered is not None and entered[0] == record.epoch:
        elapsed_s = max(0.0, now - entered[1]) + config.epoch_skew_s
        claimed = min(claimed, record.samples_per_s * elapsed_s)
    return claimed
