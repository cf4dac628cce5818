"""Waits that adapt: the averager's deadlines from what this peer measured.

A fixed wait must be guessed for the worst network a run will see (hivemind's
``averaging_expiration``, ``allreduce_timeout`` and ``next_chunk_timeout`` are such guesses; its
users ask how to set them). Too short, and a slow link looks like a dead peer: a 4 MiB chunk
takes 3.4 s on a 10 Mbit/s uplink, two of them at once 6.7 s, more than a 5 s bound. Too long,
and a peer that vanished costs everyone the whole bound on loopback, where a chunk takes
milliseconds. So each wait is estimated the way TCP estimates its retransmission timeout (RFC
6298: a measured round trip times a margin, clamped, doubled after a timeout) from what this
peer saw in its recent rounds:

* **matchmaking**: how long after a search began its partners arrived (a leader: each
  follower's ``wait``; a follower: its seat taken), and the RTTs the transport measured;
* **sender** (a reducer's wait for a sender's next chunk): how long its chunks took to come,
  and the averaged chunks to be written back to it;
* **connect** (a reducer's wait for a sender's stream, from the round's start): how long its
  senders took to connect, at least the sender wait. It is not a link's time: each member
  learns of the group and gets a CPU to open its streams, which on a host whose cores all
  train takes longer than a chunk (32 peers on 2 cores: over a second, and a floor of one
  second dropped members every few rounds, leaving replicas apart);
* **reducer** (a sender's wait for the next averaged chunk): the waits it saw, and always
  twice the sender wait and the connect wait plus a sender wait (a reducer waits out a slow
  sender, or one that has not connected, before it can answer);
* **group wait** (a stream early for its group): the connect wait (the same lag seen from the
  other side: the sender learned of the group before this reducer did);
* **request** (a matchmaking request to a peer, answered at once: ``join``, ``invite``):
  ``safety`` times 2 RTTs, at most ``request_timeout_s`` (a leader that stalled costs a
  follower about a second on loopback, not 5 s).

Each is ``safety`` times the 90th percentile of the last samples (at least ``safety`` times a
few RTTs), clamped to ``[min_deadline_s, max_deadline_s]`` (the matchmaking window to
``[min_deadline_s, matchmaking_time_s]``: that field stays the user's bound on looking for a
group). Before enough samples exist, the configured field is the estimate (the cold start; for
the connect wait, until two rounds measured it). A
sender or reducer wait that ran out doubles for the next round (up to the ceiling), and that
round's measurements are not learned (Karn's rule: they are the fast survivors); a link slower
than the cold-start guess costs the first round or two, not every round.
``allreduce_timeout_s`` stays a fixed bound on the whole exchange. With
``adaptive_deadlines=False`` every wait is its configured field, as before. Durations come
from the event loop's monotonic clock.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

from averaging.config import AveragerConfig

logger = logging.getLogger(__name__)

NUM_SAMPLES = 64  # recent samples kept per kind: a few rounds' worth
MIN_SAMPLES = 4  # below this, the configured field is the estimate
# Rounds whose connections a connect wait is learned from, at least: one round's connections
# are one draw of the host's load (all its members learned of the group at once), and a wait
# learned from a warm round dropped a sender of the next, cold one (16 peers of a bench on a
# loaded host: a quarter of that round's members, replicas apart until the next re-sync).
MIN_CONNECT_ROUNDS = 2
QUANTILE = 0.9

SENDER, CONNECT, REDUCER, MATCHMAKING = "sender", "connect", "reducer", "matchmaking"


class SampleWindow:
    """The last ``maxlen`` durations of one kind, in seconds, and their quantiles."""

    def __init__(self, maxlen: int = NUM_SAMPLES):
        self._samples: deque[float] = deque(maxlen=maxlen)

    def add(self, duration_s: float) -> None:
        if math.isfinite(duration_s) and duration_s >= 0:
            self._samples.append(duration_s)

    def __len__(self) -> int:
        return len(self._samples)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (None without samples)."""
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Deadlines:
    """The current waits of one averager, from its measurements (see the module docstring).

    Args:
        config: the bounds, the cold-start values and the safety factor.
        rtt_s: the transport's recent round-trip time in seconds (None when none was
            measured), read each time a deadline is computed.
    """

    def __init__(self, config: AveragerConfig, rtt_s: Callable[[], float | None] = lambda: None):
        self._config = config
        self._rtt_s = rtt_s
        self._samples = {kind: SampleWindow() for kind in (SENDER, CONNECT, REDUCER, MATCHMAKING)}
        # this round's waits, learned at its end (or not: see end_round)
        self._pending: dict[str, list[float]] = {SENDER: [], CONNECT: [], REDUCER: []}
        # at least this after a wait ran out
        self._backed_off_s = {SENDER: 0.0, CONNECT: 0.0, REDUCER: 0.0, MATCHMAKING: 0.0}
        self._ran_out: set[str] = set()
        self._num_rounds = {SENDER: 0, CONNECT: 0, REDUCER: 0}  # that taught each kind

    @property
    def adaptive(self) -> bool:
        return self._config.adaptive_deadlines

    # ---- measurements ------------------------------------------------------------------------

    def observe_arrival(self, offset_s: float) -> None:
        """A partner arrived ``offset_s`` seconds after this peer began looking."""
        self._samples[MATCHMAKING].add(offset_s)

    def search_ran_out(self) -> None:
        """A search saw others looking and formed no group in its window: the next window is
        twice as long (up to ``matchmaking_time_s``), and stays so until a group forms. The
        arrivals measured are the ones that came in time (Karn's rule, as for the chunk
        waits): peers that could not, on a busy host, taught the window nothing."""
        self._backed_off_s[MATCHMAKING] = 2 * self.matchmaking_s

    def group_formed(self) -> None:
        """A search formed a group: its window is the estimate again (which has learned the
        later arrivals a longer window let in)."""
        self._backed_off_s[MATCHMAKING] = 0.0

    def observe_sender_wait(self, wait_s: float) -> None:
        """As a reducer, a sender's next chunk came ``wait_s`` after it could have, or writing
        an averaged chunk to it took ``wait_s``."""
        self._pending[SENDER].append(wait_s)

    def observe_connection(self, offset_s: float) -> None:
        """As a reducer, a sender's stream came ``offset_s`` after the round began."""
        self._pending[CONNECT].append(offset_s)

    def observe_reducer_wait(self, wait_s: float) -> None:
        """As a sender, the reducer's next averaged chunk came after ``wait_s``."""
        self._pending[REDUCER].append(wait_s)

    def ran_out(self, kind: str) -> None:
        """A ``sender``, ``connect`` or ``reducer`` wait of this round ran out (a drop or a
        stall)."""
        self._ran_out.add(kind)

    def end_round(self) -> None:
        """Learn this round's waits, or back off the ones that ran out.

        As in Karn's algorithm for TCP, a round in which a wait ran out teaches nothing about
        it (what did arrive were the fast ones: the estimate would come out too short); the
        wait doubles instead, and stays so until a round without a timeout measured it.
        """
        waits = {SENDER: self.sender_s, CONNECT: self.connect_s, REDUCER: self.reducer_s}
        for kind, pending in self._pending.items():
            if kind in self._ran_out:
                self._backed_off_s[kind] = 2 * waits[kind]
            else:
                for wait_s in pending:
                    self._samples[kind].add(wait_s)
                self._num_rounds[kind] += bool(pending)
                if pending and self._learned(kind):
                    self._backed_off_s[kind] = 0.0
            pending.clear()
        self._ran_out.clear()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "waits now %s; p90 of waits for senders %s, connections %s, reducers %s, "
                "arrivals %s; rtt %s",
                {k: round(v, 3) for k, v in self.snapshot().items()},
                *(
                    self._samples[k].quantile(QUANTILE)
                    for k in (SENDER, CONNECT, REDUCER, MATCHMAKING)
                ),
                self._rtt_s(),
            )

    # ---- deadlines ---------------------------------------------------------------------------

    def _learned(self, kind: str) -> bool:
        """Whether enough was measured of ``kind`` to trust the estimate over the field."""
        if len(self._samples[kind]) < MIN_SAMPLES:
            return False
        return kind != CONNECT or self._num_rounds[CONNECT] >= MIN_CONNECT_ROUNDS

    def _estimate(self, kind: str, cold_s: float, min_rtts: float, high_s: float) -> float:
        """``safety`` times the recent 90th percentile (at least ``safety * min_rtts`` RTTs),
        clamped to ``[min_deadline_s, high_s]``; ``cold_s`` as configured before enough
        samples."""
        samples, config = self._samples[kind], self._config
        if not self._learned(kind):
            return min(cold_s, high_s)
        estimate = config.deadline_safety * samples.quantile(QUANTILE)
        rtt_s = self._rtt_s()
        if rtt_s is not None and math.isfinite(rtt_s):
            estimate = max(estimate, config.deadline_safety * min_rtts * rtt_s)
        return min(high_s, max(config.min_deadline_s, estimate))

    @property
    def sender_s(self) -> float:
        """A reducer drops a sender that delivers no next chunk (or no connection) this long."""
        config = self._config
        if not self.adaptive:
            return config.sender_timeout_s
        # at most half the ceiling, so that the reducer wait (twice this) stays above it
        high_s = config.max_deadline_s / 2
        estimate = self._estimate(SENDER, config.sender_timeout_s, 2, high_s)
        return min(high_s, max(estimate, self._backed_off_s[SENDER]))

    @property
    def connect_s(self) -> float:
        """A reducer drops a sender whose stream has not come this long after the round began
        (never sooner than the sender wait)."""
        if not self.adaptive:
            return self._config.sender_timeout_s
        high_s = self._config.max_deadline_s / 2
        # cold, the configured sender wait: the chunks of a first round bring the sender wait
        # to its floor while its connections were few, and at the start of a run (every process
        # loading) they come late the most
        sender_s = self.sender_s
        estimate = self._estimate(CONNECT, self._config.sender_timeout_s, 2, high_s)
        return min(high_s, max(estimate, sender_s, self._backed_off_s[CONNECT]))

    @property
    def reducer_s(self) -> float:
        """A sender gives up on a reducer that sends no next averaged chunk this long."""
        config = self._config
        if not self.adaptive:
            return config.reducer_timeout_s
        high_s = config.max_deadline_s
        estimate = self._estimate(REDUCER, config.reducer_timeout_s, 2, high_s)
        backed_off_s = self._backed_off_s[REDUCER]
        sender_s = self.sender_s
        return min(high_s, max(estimate, backed_off_s, 2 * sender_s, self.connect_s + sender_s))

    @property
    def group_wait_s(self) -> float:
        """A reducer holds a stream for a group it has not heard of yet this long."""
        if not self.adaptive:
            return self._config.group_wait_s
        return self.connect_s  # below the reducer wait, as the config requires of its fields

    @property
    def matchmaking_s(self) -> float:
        """A leader waits for followers (a follower for its group) at most this long."""
        config = self._config
        if not self.adaptive:
            return config.matchmaking_time_s
        # announce, read, join, wait: four round trips at least
        high_s = config.matchmaking_time_s
        estimate = self._estimate(MATCHMAKING, high_s, 4, high_s)
        return min(high_s, max(estimate, self._backed_off_s[MATCHMAKING]))

    @property
    def request_s(self) -> float:
        """A matchmaking request to a peer (answered at once) is given up after this long."""
        config = self._config
        rtt_s = self._rtt_s()
        if not self.adaptive or rtt_s is None or not math.isfinite(rtt_s):
            return config.request_timeout_s
        estimate = max(config.min_deadline_s, 2 * config.deadline_safety * rtt_s)
        return min(config.request_timeout_s, estimate)

    def snapshot(self) -> dict[str, float]:
        """The current waits in seconds, by name (what a round reports)."""
        return {
            "matchmaking_s": self.matchmaking_s,
            "sender_s": self.sender_s,
            "connect_s": self.connect_s,
            "reducer_s": self.reducer_s,
            "group_wait_s": self.group_wait_s,
            "request_s": self.request_s,
            "allreduce_s": self._config.allreduce_timeout_s,
        }
