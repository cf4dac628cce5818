"""The outcome of one averaging round, as the caller and the profiler see it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

RoundStatus = Literal["ok", "partial", "alone", "failed"]


@dataclass(frozen=True)
class RoundResult:
    """What one peer's round came to.

    Attributes:
        status: "ok" (every part averaged, nobody dropped), "partial" (some of the vector kept
            its local values or a peer was dropped), "alone" (no group formed: the caller steps
            locally) or "failed" (a group formed but nothing was averaged).
        reason: why the round is not "ok" ("" when it is).
        group_id: the group's round id (None when alone).
        members: the group's peer ids (this peer included).
        weights: each member's weight, as the group recorded it.
        dropped_peers: peers dropped by this peer as their reducer, and reducers whose part did
            not come back to this peer.
        bytes_sent: tensor bytes this peer sent in the all-reduce (chunk headers included).
        bytes_received: tensor bytes it received.
        matchmaking_s: seconds spent finding the group.
        allreduce_s: seconds spent in the all-reduce.
        averaged_fraction: the fraction of the vector replaced by an average that includes
            another peer's values.
        compression: the wire format used.
        phase_s: seconds per phase, for the profiler: "gather" (tensors to the flat vector),
            "matchmaking", "allreduce", "scatter" (back to the tensors), and the CPU seconds
            inside the all-reduce: "encode", "decode", "reduce". With a second level,
            "matchmaking" and "allreduce" include its search and all-reduces, also shown
            apart as "top_matchmaking", "top_allreduce", "spread_wait" and "spread".
        epoch: the epoch whose round this was (-1 when the caller did not say).
        deadlines_s: the waits this round used, in seconds, measured or configured
            (:meth:`averaging.allreduce.deadlines.Deadlines.snapshot`): ``matchmaking_s``,
            ``sender_s``, ``reducer_s``, ``group_wait_s``, ``request_s``, ``allreduce_s``.
        num_streams: streams per (sender, reducer) pair the group used (0 when no group
            formed; see :mod:`averaging.allreduce.streams`).
        num_reached: peers whose contributions reached this peer's final values (this peer
            included; 1 when alone or failed): the group's averaged members, or with a second
            level the peers of every row whose delegate took part (:mod:`averaging.levels`).
        levels: each level this round ran and how it ended: ``{"row": status}`` for a round of
            one group; with a second level also ``"top"`` (the delegates' round, as the
            delegate reported it, or why there was no word: "unknown", "unreachable",
            "refused") and ``"spread"`` when the delegate's values were taken.
        search_key: the DHT key this peer's (first-level) search looked under: the round's
            matchmaking key, with its bucket when the key is sharded
            (:func:`averaging.matchmaking.rows.bucket_key`); "" for a group given by the caller.
    """

    status: RoundStatus
    reason: str = ""
    group_id: str | None = None
    members: tuple[str, ...] = ()
    weights: Mapping[str, float] = field(default_factory=dict)
    dropped_peers: tuple[str, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    averaged_fraction: float = 0.0
    compression: str = "none"
    phase_s: Mapping[str, float] = field(default_factory=dict)
    epoch: int = -1
    deadlines_s: Mapping[str, float] = field(default_factory=dict)
    num_streams: int = 0
    num_reached: int = 1
    levels: Mapping[str, str] = field(default_factory=dict)
    search_key: str = ""

    @property
    def ok(self) -> bool:
        """The caller may step on the tensors: averaged (fully or partly), or alone."""
        return self.status != "failed"

    @property
    def num_peers(self) -> int:
        """The group's size, this peer included (1 when alone or failed)."""
        return max(1, len(self.members))

    @property
    def averaged_with(self) -> tuple[str, ...]:
        """The members whose values are in the average (a dropped one is nobody's partner)."""
        return tuple(m for m in self.members if m not in self.dropped_peers)

    @property
    def num_dropped(self) -> int:
        """Peers dropped from the round."""
        return len(self.dropped_peers)

    @property
    def partial(self) -> bool:
        """Some of the vector was not averaged, or a peer was dropped."""
        return self.status == "partial"

    @property
    def averaged(self) -> bool:
        """The tensors now hold (at least partly) the group's average."""
        return self.status in ("ok", "partial")

    @property
    def round_s(self) -> float:
        """Seconds of the whole step."""
        phases = ("gather", "matchmaking", "allreduce", "scatter")
        return sum(self.phase_s.get(phase, 0.0) for phase in phases)
