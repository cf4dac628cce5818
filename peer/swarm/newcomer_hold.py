"""Holding a lone peer's epoch boundary while a peer behind it catches up.

A peer alone at its epoch steps as soon as it has the target batch. With epochs shorter than a
state download (a demo's sub-second epochs), a newcomer can never catch it: by the time the
state of epoch E has arrived, the lone peer is at E+3, the newcomer is behind again, downloads
again, and so on. So a peer alone at its epoch that has reached its target, and sees a fresh
progress record of a peer behind it (a newcomer, or a peer whose round failed, both of which
download the state next), keeps accumulating instead of stepping, for at most ``wait_s`` (plus
``round_s``: the peer behind may first wait out a round of its own): the
state it serves stays at its epoch, the other peer arrives there, and the epoch ends with a
round of two. The lone peer loses no work (its epoch just gathers a larger batch). A peer that
does not arrive within ``wait_s`` is not waited for again, so a peer that keeps failing costs
one wait, not one per epoch; once it averages with this peer after all, it is waited for again.
Peers that are not alone never hold: the swarm does not wait for laggards.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from dht.config import get_dht_time
from dht.errors import ConfigError
from peer.swarm.progress import GlobalProgress

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewcomerHoldConfig:
    """Attributes:
    wait_s: the longest a lone peer holds its epoch boundary for a peer catching up, in
        seconds; also how fresh (DHT time) that peer's progress record must be, plus
        ``round_s``. 0 disables. Longer than a round's matchmaking wait by default: a
        newcomer that took a stale record for a partner at its epoch spends that wait in a
        round of its own first.
    round_s: the longest a peer spends in a round that finds no group (the matchmaking
        wait). A peer behind may wait out such a round before it downloads, reporting
        nothing: the hold and the freshness of its record both get ``round_s`` more. With
        ``wait_s`` alone, the hold ran out just as that round ended (matchmaking wait ==
        newcomer wait), the lone peer stepped on, and the newcomer arrived behind it again,
        every epoch (issue 24).
    """

    wait_s: float = 10.0
    round_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.wait_s >= 0:
            raise ConfigError(f"newcomer wait must be >= 0 seconds, got {self.wait_s}")
        if not self.round_s >= 0:
            raise ConfigError(f"round_s must be >= 0 seconds, got {self.round_s}")


class NewcomerHold:
    """Decides, at each step past the target, whether a lone peer holds its epoch boundary.

    Args:
        config: how long to hold.
        monotonic: the clock the hold is timed with (tests inject one).
        dht_time: the DHT's wall clock, which progress records are stamped with.
    """

    def __init__(
        self,
        config: NewcomerHoldConfig,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        dht_time: Callable[[], float] = get_dht_time,
    ):
        self.config = config
        self._monotonic = monotonic
        self._dht_time = dht_time
        self._since_s: float | None = None
        self._given_up: set[str] = set()
        self.num_holds = 0

    def should_hold(self, swarm: GlobalProgress, epoch: int) -> bool:
        """True while this lone peer (at ``epoch``, target reached) should keep accumulating.

        ``swarm.peers[0]`` is this peer's own record, the rest are the others'.
        """
        if self.config.wait_s <= 0:
            return False
        # a peer behind may first wait out a round of its own (round_s), reporting nothing
        hold_s = self.config.wait_s + self.config.round_s
        oldest_s = self._dht_time() - hold_s
        behind = [
            peer.peer_id
            for peer in swarm.peers[1:]
            if peer.epoch < epoch and peer.time >= oldest_s and peer.peer_id not in self._given_up
        ]
        if not behind:
            self._since_s = None
            return False
        now_s = self._monotonic()
        if self._since_s is None:
            self._since_s = now_s
            self.num_holds += 1
            logger.info(
                "epoch %d: holding the epoch up to %.1f s for %d peer(s) catching up",
                epoch,
                hold_s,
                len(behind),
            )
            return True
        if now_s - self._since_s < hold_s:
            return True
        logger.info("epoch %d: no longer waiting for %d peer(s) behind", epoch, len(behind))
        self._given_up.update(behind)
        self._since_s = None
        return False

    def arrived(self, peer_ids: Iterable[str]) -> None:
        """``peer_ids`` averaged with this peer: those it gave up on arrived after all, and a
        later wait for them is not one more for a peer that keeps failing. Without this, a
        newcomer that took longer than the wait to start was never held for again: when it
        fell behind once more (a round failed under load), the lone peer ahead stepped on
        alone through its download, and the two replicas stayed apart in ``grad`` mode."""
        self._given_up.difference_update(peer_ids)

    def reset(self) -> None:
        """The epoch ended: the next hold starts its own wait."""
        self._since_s = None
