"""The simulated swarm of :mod:`peer.bench.swarm_sim`: its peers and the events that drive them.

What runs is the real logic of a peer's progress (:mod:`peer.swarm.progress_sample`: the
layout, the buckets read, the smoothed size; :func:`peer.swarm.progress_estimate.estimate`, with
partners from the rounds) and of matchmaking discovery (an announcement under the sharded
matchmaking key, :func:`averaging.matchmaking.rows.num_buckets` from the peer's own estimate of
``N`` at its epoch, or from the count its last round reached
(:class:`averaging.rounds.LayoutMemory`, modelled as every peer of the epoch that met another:
the top round joins their rows), then reads of that key), over the DHT of
:mod:`peer.bench.swarm_sim_dht` (an explicit, measured simplification of the real one).
Training is a stand-in: each peer accumulates samples at its own rate (log-normal around
``MEAN_RATE``); a peer whose estimate says the target is reached
announces itself, waits out matchmaking and the round, and starts the next epoch with the peers
it met as partners. Churn replaces random peers with newcomers (who probe the layout, and start
at the swarm's epoch, as after a state download).

Events (a join, a peer's refresh ``tick``, its ``check`` after a local step, the ``resolve`` of
its round, churn, the start of the measurement window) run in virtual-time order from one heap;
the swarm keeps the tallies that :mod:`peer.bench.swarm_sim` turns into figures.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

from averaging.config import AveragerConfig
from averaging.matchmaking import rows
from averaging.rounds import LayoutMemory
from peer.bench.swarm_sim_dht import CostModel, SimDHT
from peer.records.progress import PROBE_LEVELS, PeerProgress, bucket_key, bucket_of, write_levels
from peer.records.progress_read import levels_beside, newest_per_peer, probe_count
from peer.swarm.progress_config import ProgressConfig
from peer.swarm.progress_estimate import GlobalProgress, estimate
from peer.swarm.progress_sample import (
    Reprobe,
    SampleRead,
    SizeEstimate,
    plan_read,
)
from peer.swarm.progress_schedule import publish_due, read_interval_s, record_lifetime_s

PREFIX = "sim"
MEAN_RATE = 100.0  # samples/s of the mean peer
RATE_SIGMA = 0.3  # log-normal spread of the peers' rates
EPOCH_S = 20.0  # the target batch size is what the swarm makes in this long
MATCHMAKING_S = 3.0  # a ready peer waits this long for others under its key
ROUND_S = 1.0  # then averages this long
NUM_MATCHMAKING_READS = 2  # reads of the matchmaking key while waiting
RAMP_S = 20.0  # the swarm joins over this long...
SETTLE_S = 30.0  # ...and settles this long (past size_window_s) before the measurement window
ANNOUNCE_TTL_S = 30.0
MATCHMAKING = AveragerConfig()  # the replicas its announcements go to and its reads merge


def matchmaking_key(epoch: int, peer_id: str, num_buckets: int) -> str:
    # the bucket is drawn from the run's key, as the averager does: the same every epoch
    return rows.bucket_key(f"{PREFIX}/mm/{epoch}", peer_id, num_buckets, seed=f"{PREFIX}/mm")


@dataclass
class SimPeer:
    """One simulated peer: the training stand-in and its tracker's state (what
    :class:`peer.swarm.progress.ProgressTracker` keeps, without the network)."""

    peer_id: str
    slot: int
    rate: float
    epoch: int
    samples: float  # at ``anchor_s`` (frozen while waiting)
    anchor_s: float
    training: bool = True
    alive: bool = True
    size: SizeEstimate = field(default_factory=lambda: SizeEstimate(30.0))
    rounds: deque = field(default_factory=lambda: deque(maxlen=8))
    round_peers: dict = field(default_factory=dict)
    partners: frozenset = frozenset()
    num_reads: int = 0
    records: list = field(default_factory=list)
    sample: object = None
    mm_key: str = ""
    ready_s: float = 0.0
    published: tuple | None = None  # what the tracker last stored (progress_schedule.publish_due)
    cycles_s: deque = field(default_factory=lambda: deque(maxlen=4))  # its refresh cycles
    last_tick_s: float | None = None
    last_read_s: float = -math.inf  # the last read's start (progress_schedule.read_interval_s)
    num_keys_read: int = 0  # by the last read
    reprobe: Reprobe | None = None  # set at join (the config's interval)
    met_epoch: int | None = None  # the last epoch at which it met another peer

    def samples_at(self, now: float) -> float:
        return self.samples + (self.rate * (now - self.anchor_s) if self.training else 0.0)

    def recent_partners(self) -> list[str]:
        return list(dict.fromkeys(p for peers in reversed(self.rounds) for p in sorted(peers)))


class SimSwarm:
    """The swarm on its virtual clock: its peers, the DHT they share, the event heap, and the
    tallies that the measurement window's figures are made of.

    Args:
        num_peers: peers once the ramp is over (churn keeps the number).
        seconds: the measurement window, in virtual seconds (with the churn, it sizes the
            DHT's table of nodes).
        churn_per_s: the fraction of the swarm replaced per second.
        seed: seeds every random choice.
        g: ``target_group_size`` of matchmaking.
        busy_s: each refresh cycle runs up to this many seconds late (uniform).
        layout_memory: lay the keys out for the count of the last round; False: from each
            peer's own estimate.
    """

    def __init__(
        self,
        num_peers: int,
        seconds: float,
        churn_per_s: float,
        seed: int,
        g: int,
        busy_s: float,
        layout_memory: bool,
    ):
        self.rng = random.Random(seed)
        self.group_size = g
        self.busy_s = busy_s
        self.layout_memory = layout_memory
        self.num_met_at: Counter = Counter()  # peers that met another, by epoch
        self.words: dict[int, int] = {}  # the count each epoch's members hold, by epoch
        self.layouts: dict[int, Counter] = defaultdict(Counter)  # searches by epoch, layout
        self.config = ProgressConfig(
            target_batch_size=max(1, round(num_peers * MEAN_RATE * EPOCH_S)),
            publish_interval_s=2.0,
            record_ttl_s=20.0,
        )
        capacity = int(num_peers * (1 + 2 * churn_per_s * (RAMP_S + SETTLE_S + seconds))) + 16
        self.dht = SimDHT(CostModel(), self.rng, capacity)
        self.peers: dict[str, SimPeer] = {}
        self.alive: list[str] = []
        self.events: list = []
        self._seq = 0
        self.truth: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.window_start_s = RAMP_S + SETTLE_S
        self.errors: list[float] = []
        self.size_ratios: list[float] = []
        self.num_ready = self.num_met = 0
        self.announced: dict[str, list[tuple[str, float]]] = defaultdict(list)
        self.num_keys_read: list[int] = []

    # ---- bookkeeping -------------------------------------------------------------------------

    def schedule(self, at_s: float, kind: str, peer_id: str = "") -> None:
        self._seq += 1
        heapq.heappush(self.events, (at_s, self._seq, kind, peer_id))

    def _count(self, peer: SimPeer, sign: float) -> None:
        """Add (or take away) ``peer``'s samples in the true per-epoch sums: a linear function
        of the time while it trains, a constant while it waits."""
        sums = self.truth[peer.epoch]
        if peer.training:
            sums[0] += sign * (peer.samples - peer.rate * peer.anchor_s)
            sums[1] += sign * peer.rate
        else:
            sums[0] += sign * peer.samples

    def true_samples(self, epoch: int, now: float) -> float:
        constant, rate = self.truth[epoch]
        return constant + rate * now

    def join(self, now: float, epoch: int) -> None:
        peer_id = self.rng.randbytes(32).hex()
        rate = MEAN_RATE * self.rng.lognormvariate(-(RATE_SIGMA**2) / 2, RATE_SIGMA)
        peer = SimPeer(peer_id, self.dht.join(peer_id), rate, epoch, 0.0, now)
        peer.size = SizeEstimate(self.config.size_window_s)
        peer.reprobe = Reprobe(self.config.publish_interval_s, self.config.records_per_bucket, 0.0)
        self.peers[peer_id] = peer
        self.alive.append(peer_id)
        self._count(peer, 1)
        self.schedule(now + self.rng.uniform(0, self.config.publish_interval_s), "tick", peer_id)

    def leave(self) -> None:
        peer = self.peers[self.alive.pop(self.rng.randrange(len(self.alive)))]
        peer.alive = False
        self._count(peer, -1)
        self.dht.leave(peer.peer_id)

    # ---- a peer's progress -------------------------------------------------------------------

    def _own(self, peer: SimPeer, now: float) -> PeerProgress:
        samples = int(peer.samples_at(now))
        return PeerProgress(peer.peer_id, peer.epoch, samples, peer.rate, now, None, False)

    def _read_bucket(
        self, peer: SimPeer, level: int, bucket: int, now: float, replicas: int | None = None
    ) -> list:
        # every writer here is honest and writes its own bucket: no record to filter out
        return self.dht.get(peer.slot, bucket_key(PREFIX, level, bucket), now, replicas)

    def _probe_size(self, peer: SimPeer, now: float) -> float:
        """:func:`peer.swarm.progress_sample.probe_size`, on the simulated DHT."""

        def count(levels) -> dict[int, float]:
            return {
                lv: probe_count(
                    self._read_bucket(
                        peer, lv, bucket_of(peer.peer_id, lv), now, self.config.read_replicas
                    ),
                    peer.peer_id,
                    lv,
                )
                for lv in levels
            }

        peer.reprobe.mark(peer.num_reads, now)
        sizes = count(PROBE_LEVELS)
        sizes |= count(levels_beside(max(sizes, key=sizes.__getitem__)))
        return max(sizes.values())

    def tick(self, peer: SimPeer, now: float) -> None:
        """Publish at the levels written, read the planned buckets (every few ticks where
        they are more than an interval's keys), estimate, decide."""
        # a busy host: the next refresh starts up to busy_s late (its DHT requests queue)
        late_s = self.rng.uniform(0.0, self.busy_s) if self.busy_s else 0.0
        self.schedule(now + self.config.publish_interval_s + late_s, "tick", peer.peer_id)
        if peer.last_tick_s is not None:
            peer.cycles_s.append(now - peer.last_tick_s)
        peer.last_tick_s = now
        if peer.size.value is None:
            peer.size.update(self._probe_size(peer, now), now, exact=True)
        own = self._own(peer, now)
        self._publish(peer, own, now)
        interval_s = self.config.publish_interval_s
        if (
            now - peer.last_read_s
            < read_interval_s(peer.num_keys_read, self.config) - 0.5 * interval_s
        ):
            # no read this tick: the last records, extrapolated (its error counted too)
            self._decide(peer, self._view(peer, own, now), now)
            return
        peer.last_read_s = now
        partners = peer.recent_partners()
        level = peer.size.level(self.config.records_per_bucket)
        plan = plan_read(level, peer.peer_id, partners, self.config, self.rng, peer.num_reads)
        peer.num_reads += 1
        peer.num_keys_read = len(plan.buckets)
        replicas = self.config.read_replicas
        found = {b: self._read_bucket(peer, level, b, now, replicas) for b in plan.buckets}
        fills = {b: len({r.peer_id for r in records}) for b, records in found.items()}
        records = newest_per_peer(r for bucket in found.values() for r in bucket)
        read = SampleRead(plan, records, fills)
        raw, exact = read.raw_size(peer.peer_id), plan.complete
        if peer.reprobe.due(peer.num_reads, now, level, raw, peer.size.value):
            raw, exact = Reprobe.adopt(raw, exact, self._probe_size(peer, now))
        size = peer.size.update(raw, now, exact=exact)
        peer.records, peer.sample = records, read.sample(partners, size)
        view = self._view(peer, own, now)
        if now >= self.window_start_s:
            self.num_keys_read.append(len(plan.buckets))
            self.size_ratios.append(size / len(self.alive))
        self._decide(peer, view, now)

    def _publish(self, peer: SimPeer, own: PeerProgress, now: float) -> None:
        levels = tuple(write_levels(peer.size.value, self.config.records_per_bucket))
        if publish_due(peer.published, own, levels, now, self.config):
            expiration = now + record_lifetime_s(peer.cycles_s, self.config)
            for level in levels:
                key = bucket_key(PREFIX, level, bucket_of(peer.peer_id, level))
                self.dht.store(
                    peer.slot, key, peer.peer_id, own, expiration, self.config.store_replicas
                )
            peer.published = (own, levels, now)

    def _decide(self, peer: SimPeer, view: GlobalProgress, now: float) -> None:
        if not peer.training:
            return
        truth = self.true_samples(peer.epoch, now)
        if now >= self.window_start_s and view.epoch == peer.epoch:
            if truth >= 0.1 * self.config.target_batch_size:
                self.errors.append(abs(view.samples_accumulated - truth) / truth)
        if view.ready or view.epoch > peer.epoch:
            self._ready(peer, view, now)
        elif view.eta_next_epoch_s < self.config.publish_interval_s:
            self.schedule(now + view.eta_next_epoch_s, "check", peer.peer_id)

    def check(self, peer: SimPeer, now: float) -> None:
        """The training loop's look after a local step: the last records read, extrapolated,
        and this peer's live numbers (``ProgressTracker.current``; no network)."""
        if not peer.training:
            return
        view = self._view(peer, self._own(peer, now), now)
        if view.ready or view.epoch > peer.epoch:
            self._ready(peer, view, now)

    def _view(self, peer: SimPeer, own: PeerProgress, now: float) -> GlobalProgress:
        return estimate(
            peer.records,
            own=own,
            config=self.config,
            now=now,
            round_peers=peer.round_peers,
            partners=peer.partners,
            sample=peer.sample,
        )

    # ---- matchmaking discovery ---------------------------------------------------------------

    def _ready(self, peer: SimPeer, view: GlobalProgress, now: float) -> None:
        self._count(peer, -1)
        peer.samples, peer.anchor_s, peer.training = peer.samples_at(now), now, False
        self._count(peer, 1)
        num_at = max(1, view.num_at(peer.epoch))
        layout = None
        if self.layout_memory and peer.met_epoch is not None:
            # the top round's word: one count for every member, fixed when the first is read
            word = self.words.setdefault(peer.met_epoch, self.num_met_at[peer.met_epoch])
            memory = LayoutMemory(peer.met_epoch, word)
            layout = memory.layout_peers(peer.epoch, num_at)
        buckets = rows.num_buckets(layout or num_at, self.group_size)
        if now >= self.window_start_s:
            self.layouts[peer.epoch][buckets] += 1
        peer.mm_key = matchmaking_key(peer.epoch, peer.peer_id, buckets)
        peer.ready_s = now
        expiration = now + ANNOUNCE_TTL_S
        self.dht.store(
            peer.slot,
            peer.mm_key,
            peer.peer_id,
            peer.peer_id,
            expiration,
            MATCHMAKING.store_replicas,
        )
        for _ in range(NUM_MATCHMAKING_READS):
            self.dht.get(peer.slot, peer.mm_key, now, MATCHMAKING.read_replicas)
        self.announced[peer.mm_key].append((peer.peer_id, now))
        self.schedule(now + MATCHMAKING_S + ROUND_S, "resolve", peer.peer_id)

    def _met(self, table: dict, key: str, peer: SimPeer) -> list[str]:
        return [
            other
            for other, at_s in table[key]
            if other != peer.peer_id
            and abs(at_s - peer.ready_s) <= MATCHMAKING_S
            and self.peers[other].alive
        ]

    def resolve(self, peer: SimPeer, now: float) -> None:
        """The round is over: the peers met under the key are the new partners."""
        met = self._met(self.announced, peer.mm_key, peer)
        if peer.ready_s >= self.window_start_s:
            self.num_ready += 1
            self.num_met += bool(met)
        if met:
            self.num_met_at[peer.epoch] += 1
            peer.met_epoch = peer.epoch
        group = sorted(met, key=lambda p: abs(self.peers[p].ready_s - peer.ready_s))
        group = frozenset(group[: self.group_size - 1])
        self._count(peer, -1)
        peer.epoch += 1
        peer.samples, peer.anchor_s, peer.training = 0.0, now, True
        self._count(peer, 1)
        peer.round_peers = {p: (peer.epoch, now) for p in group}
        peer.rounds.append(group)
        peer.partners = frozenset().union(*peer.rounds)

    # ---- the run -----------------------------------------------------------------------------

    def churn(self, now: float, churn_per_s: float) -> None:
        """One peer leaves, a newcomer joins at the swarm's epoch (its state downloaded)."""
        self.schedule(now + self.rng.expovariate(churn_per_s * len(self.alive)), "churn")
        if now < self.window_start_s - SETTLE_S or len(self.alive) < 2:
            return
        self.leave()
        epochs = Counter(self.peers[p].epoch for p in self.alive)
        self.join(now, epochs.most_common(1)[0][0])

    def run(self, num_peers: int, seconds: float, churn_per_s: float) -> None:
        for index in range(num_peers):
            self.schedule(RAMP_S * index / num_peers, "join")
        if churn_per_s > 0:
            self.schedule(RAMP_S, "churn")
        self.schedule(self.window_start_s, "window")
        end_s = self.window_start_s + seconds
        while self.events and self.events[0][0] < end_s:
            now, _, kind, peer_id = heapq.heappop(self.events)
            if kind == "join":
                self.join(now, 0)
            elif kind == "churn":
                self.churn(now, churn_per_s)
            elif kind == "window":
                self.max_key_bytes_ramp = self.dht.max_key_bytes()
                self.dht.max_key_records = 0
                self.bytes_at_window = self.dht.node_bytes.copy()
                self.alive_at_window = list(self.alive)
            elif self.peers[peer_id].alive:
                getattr(self, kind)(self.peers[peer_id], now)
