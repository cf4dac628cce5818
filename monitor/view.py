"""The frame the dashboard draws: immutable views of the swarm, its peers, rounds and alerts
(built by :class:`monitor.state.ViewBuilder`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dht.identity import short_id
from dht.reach.reachability import Path, path_of
from peer.records.profile import ProfileRecord
from peer.records.rounds import RoundLogRecord


@dataclass(frozen=True, kw_only=True)
class PeerView:
    """One peer as the dashboard shows it.

    Attributes:
        peer_id: its id.
        address: the URL it serves on (a relay's for a relayed peer), or None (client mode).
        epoch: its epoch; samples: samples accumulated in it; samples_per_s: its rate.
        age_s: seconds since its progress record was published (its "last seen").
        profile: its profile summary, if it publishes one.
        rounds: its round record, if it publishes one.
        behind: its epoch is behind the swarm's.
        straggler: its rate is well below the swarm's median.
        stale: its progress record is older than ``stale_after_s`` (out of date).
        local: it is the peer this dashboard runs in.
        replica_differs: the digest of its state at its latest epoch differs from the one most
            peers at that epoch announce (``{run}/state``): its replica drifted, or it lies.
    """

    peer_id: str
    address: str | None
    epoch: int
    samples: int
    samples_per_s: float
    age_s: float
    profile: ProfileRecord | None = None
    rounds: RoundLogRecord | None = None
    behind: bool = False
    straggler: bool = False
    stale: bool = False
    local: bool = False
    replica_differs: bool = False

    @property
    def short_id(self) -> str:
        return short_id(self.peer_id)

    @property
    def client_mode(self) -> bool:
        return self.address is None

    @property
    def path(self) -> Path:
        """How the swarm reaches it: ``direct``, ``relayed`` (its address is a relay's) or
        ``client`` (not at all: no address)."""
        return path_of(self.address)


@dataclass(frozen=True, kw_only=True)
class RoundRow:
    """One epoch's round, merged over the peers that reported it.

    Attributes:
        epoch: the epoch the round closed.
        end_time: DHT time the last reporter finished it.
        num_reporting: peers whose round record has this epoch.
        group_sizes: the size of each distinct group, largest first.
        num_swarm_peers: peers online when the view was built (the share's denominator).
        duration_s: the longest matchmaking + all-reduce time reported.
        sent_bytes: tensor bytes sent by all reporters together.
        num_dropped: the most dropped peers any reporter saw.
        averaged_fraction: mean fraction truly averaged over the reporters.
        num_local: reporters that stepped on local data only (alone or failed).
        num_failed: reporters whose round failed.
        num_partial: reporters whose round was partial.
        status: the worst status reported (``failed`` > ``partial`` > ``alone`` > ``ok``).
        loss: mean loss the reporters had when the round ended, or None.
    """

    epoch: int
    end_time: float
    num_reporting: int
    group_sizes: tuple[int, ...]
    num_swarm_peers: int
    duration_s: float
    sent_bytes: int
    num_dropped: int
    averaged_fraction: float
    num_local: int
    num_failed: int
    status: str
    loss: float | None = None
    num_partial: int = 0

    @property
    def num_ok(self) -> int:
        """Reporters whose round was ``ok``."""
        return self.num_reporting - self.num_partial - self.num_local

    @property
    def swarm_share(self) -> float:
        """Share of the swarm in the largest group."""
        largest = self.group_sizes[0] if self.group_sizes else 0
        return min(1.0, largest / self.num_swarm_peers) if self.num_swarm_peers else 0.0


@dataclass(frozen=True)
class Alert:
    """Something the viewer should notice. ``level``: ``info``, ``warning`` or ``error``."""

    level: str
    text: str
    time: float


@dataclass(frozen=True)
class SwarmVerdict:
    """The swarm's bottleneck: the most common verdict of the peers' profiles.

    Attributes:
        bottleneck: ``data``, ``compute``, ``communication``, ``swarm`` or ``balanced``.
        num_agree: profiled peers with that verdict; num_profiled: profiled peers.
        fractions: mean share of the dashboard's four groups (data/compute/comm/idle).
        example: one agreeing peer's sentence of evidence.
    """

    bottleneck: str
    num_agree: int
    num_profiled: int
    fractions: dict[str, float]
    example: str = ""


@dataclass(frozen=True, kw_only=True)
class SwarmView:
    """One frame of the dashboard: the swarm as read at ``time`` (DHT time, unix seconds).

    ``target_batch_size`` is None when no peer published it and none was given; then the header
    shows samples without a bar.
    """

    run_id: str
    time: float
    epoch: int = 0
    target_batch_size: int | None = None
    samples_accumulated: int = 0
    samples_per_s: float = 0.0
    eta_s: float = math.inf
    peers: tuple[PeerView, ...] = ()
    rounds: tuple[RoundRow, ...] = ()
    loss_history: tuple[tuple[float, float], ...] = ()
    verdict: SwarmVerdict | None = None
    alerts: tuple[Alert, ...] = ()
    local_peer_id: str | None = None
    error: str | None = None
    num_rounds: int = 0
    num_failed_rounds: int = 0

    @property
    def num_peers(self) -> int:
        return len(self.peers)

    @property
    def num_clients(self) -> int:
        return sum(peer.client_mode for peer in self.peers)

    @property
    def num_relayed(self) -> int:
        return sum(peer.path == "relayed" for peer in self.peers)

    @property
    def progress_fraction(self) -> float | None:
        if not self.target_batch_size:
            return None
        return min(1.0, self.samples_accumulated / self.target_batch_size)

    @property
    def loss(self) -> float | None:
        return self.loss_history[-1][1] if self.loss_history else None

    def peer(self, peer_id: str | None) -> PeerView | None:
        return next((p for p in self.peers if p.peer_id == peer_id), None)
