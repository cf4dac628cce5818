"""Holding the epoch boundary of a peer that ran ahead of most of the swarm, until they arrive.

Rounds form among peers at one epoch, so two groups of peers at different epochs never average
with each other, and their replicas never meet again. A split forms when some peers step without
the others (a row whose top round found no group keeps its own mean) and then run faster: 32
``peer join`` peers ended with 7 of them five epochs ahead of the other 25. The group behind
merges forward only when a third of the others is ahead (:mod:`peer.swarm.progress_estimate`);
a smaller group ahead would stay apart to the end, and the replica check
(:mod:`peer.swarm.state_resync`), which compares the digests of one epoch, never finds the two
groups at one epoch.

So a peer whose epoch is :data:`SPLIT_MIN_GAP` or more ahead of a strict majority of the peers it
sees (weighted as the estimate weighs them; at least :data:`MIN_BEHIND` of them) keeps
accumulating at its target instead of stepping, until that majority is no longer behind it (then
the replica check compares the two groups at a shared epoch, and the smaller one re-syncs to the
larger one's replica), or for at most ``wait_s``. It loses no work: its epoch gathers a larger
batch. A hold that ran out (the peers behind did not come: they left, or they are a stranger's
records) is not started again for the next few epochs, twice as many after each one that ran
out, so that records of peers that never come cost a bounded share of the time, not a hold per
epoch; a hold that ended with the others' arrival resets that.

A record lags its peer by up to a few publishing intervals, and with epochs shorter than that,
every peer's record shows it epochs behind while it keeps pace. So a record counts as behind
only when its peer would still be more than one epoch behind had it gone on at the swarm's pace
since the record was made. An epoch's time is the median of this peer's last epochs (from the
moment it was ready in one to the moment it was ready in the next: rounds included), and at
least the target over the swarm's estimated rate: the rate alone put 32 busy peers' 10-s epochs
at 0.5 s, and every record looked like one that kept pace.

The others' epochs are claims, as everywhere in the estimate: a strict majority of the records
read can already move this peer's epoch forward (a majority ahead); here, a majority behind can
slow it by at most ``wait_s`` per hold.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable

from dht.config import get_dht_time
from dht.errors import ConfigError
from peer.records.progress import PeerProgress
from peer.swarm.progress import GlobalProgress

logger = logging.getLogger(__name__)

# Epochs a majority must be behind for a hold to start (one behind is only a group whose round
# ended later); the hold lasts while a majority is behind at all.
SPLIT_MIN_GAP = 2
# Peers behind, at least, for a hold to start (one peer behind is a newcomer or a failed round:
# peer.swarm.newcomer_hold holds for it when this peer is alone).
MIN_BEHIND = 2
# Epochs without a hold after one that ran out (doubling, up to MAX_BACKOFF_EPOCHS).
MIN_BACKOFF_EPOCHS = 4
MAX_BACKOFF_EPOCHS = 64
# Epoch times the pace is taken from (their median).
NUM_EPOCH_TIMES = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitHoldConfig:
    """Attributes:
    wait_s: the longest a peer ahead of most of the swarm holds its epoch boundary for them,
        in seconds (0 never holds). Long enough for a majority two or three epochs behind to
        arrive.
    """

    wait_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.wait_s >= 0:
            raise ConfigError(f"split wait must be >= 0 seconds, got {self.wait_s}")


class SplitHold:
    """Decides, at each check past the target, whether this peer holds its epoch boundary for
    the majority behind it (call from the training thread only).

    Args:
        config: how long to hold.
        monotonic: the clock the hold is timed with (tests inject one).
        dht_time: the DHT's wall clock, which progress records are stamped with.
    """

    def __init__(
        self,
        config: SplitHoldConfig,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        dht_time: Callable[[], float] = get_dht_time,
    ):
        self.config = config
        self._monotonic = monotonic
        self._dht_time = dht_time
        self._since_s: float | None = None
        self._epoch = -1  # the epoch held
        self._next_allowed_epoch = 0
        self._backoff_epochs = MIN_BACKOFF_EPOCHS
        self._ready_at: tuple[int, float] | None = None  # the epoch, when first ready in it
        self._epoch_times: collections.deque[float] = collections.deque(maxlen=NUM_EPOCH_TIMES)
        self.num_holds = 0
        self.num_timeouts = 0

    def should_hold(self, swarm: GlobalProgress, epoch: int) -> bool:
        """True while this peer (at ``epoch``, its target reached) should keep accumulating.

        ``swarm.peers[0]`` is this peer's own record, the rest are the others' (weighted by
        ``swarm.weights`` in a sample of a large swarm).
        """
        if self.config.wait_s <= 0:
            return False
        self._note_ready(epoch)
        if self._since_s is not None and self._epoch != epoch:
            self._since_s = None  # the epoch moved under the hold (a download): a new decision
        if self._since_s is None:
            return self._start(swarm, epoch)
        if _share_behind(swarm, epoch, lag=lambda peer: epoch - peer.epoch)[0] <= 0.5:
            logger.info("epoch %d: the peers behind arrived; the hold ends", epoch)
            self._since_s = None
            self._backoff_epochs = MIN_BACKOFF_EPOCHS
            return False
        if self._monotonic() - self._since_s < self.config.wait_s:
            return True
        self.num_timeouts += 1
        logger.warning(
            "epoch %d: most peers seen are still behind after %.0f s; stepping on (no hold for "
            "%d epochs)",
            epoch,
            self.config.wait_s,
            self._backoff_epochs,
        )
        self._since_s = None
        self._next_allowed_epoch = epoch + self._backoff_epochs
        self._backoff_epochs = min(2 * self._backoff_epochs, MAX_BACKOFF_EPOCHS)
        return False

    def _start(self, swarm: GlobalProgress, epoch: int) -> bool:
        if epoch < self._next_allowed_epoch:
            return False
        epoch_s = self._epoch_s(swarm)
        if epoch_s <= 0:
            return False
        now = self._dht_time()

        def lag(peer: PeerProgress) -> float:  # epochs behind, had it kept the swarm's pace
            return epoch - peer.epoch - max(0.0, now - peer.time) / epoch_s

        share, num_behind, num_seen = _share_behind(
            swarm, epoch, lag=lag, min_lag=SPLIT_MIN_GAP - 1
        )
        if share <= 0.5 or num_behind < MIN_BEHIND:
            return False
        self._since_s = self._monotonic()
        self._epoch = epoch
        self.num_holds += 1
        logger.info(
            "epoch %d: %d of the %d peers seen are %d or more epochs behind; holding the epoch "
            "up to %.0f s for them",
            epoch,
            num_behind,
            num_seen,
            SPLIT_MIN_GAP,
            self.config.wait_s,
        )
        return True

    def _note_ready(self, epoch: int) -> None:
        now_s = self._monotonic()
        last = self._ready_at
        if last is not None and last[0] == epoch:
            return
        if last is not None and epoch == last[0] + 1:
            self._epoch_times.append(now_s - last[1])
        self._ready_at = (epoch, now_s)

    def _epoch_s(self, swarm: GlobalProgress) -> float:
        """An epoch's time at the swarm's pace (0: unknown)."""
        measured = statistics.median(self._epoch_times) if self._epoch_times else 0.0
        by_rate = swarm.target_batch_size / swarm.samples_per_s if swarm.samples_per_s > 0 else 0.0
        return max(measured, by_rate)


def _share_behind(
    swarm: GlobalProgress, epoch: int, *, lag: Callable[[PeerProgress], float], min_lag: float = 0
) -> tuple[float, int, int]:
    """The weighted share of the other peers seen whose ``lag`` behind ``epoch`` is more than
    ``min_lag`` epochs, how many records those are, and how many records there are."""
    weights = swarm.weights or (1.0,) * len(swarm.peers)
    others = list(zip(swarm.peers[1:], weights[1:], strict=True))
    total = sum(weight for _, weight in others)
    behind = [(peer, weight) for peer, weight in others if lag(peer) > min_lag]
    if total <= 0:
        return 0.0, 0, 0
    return sum(weight for _, weight in behind) / total, len(behind), len(others)
