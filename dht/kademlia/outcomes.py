"""What the node's operations report back: where a store's records went, how a get went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dht.kademlia.storage import ValueWithExpiration


@dataclass(frozen=True)
class Replication:
    """Where records went: replicas that accepted them, replicas found, lookup depth."""

    num_accepted: int
    num_replicas: int
    hops: int


@dataclass(frozen=True)
class StoreOutcome:
    """How a store went.

    Attributes:
        ok: at least one replica (this node included) accepted the value.
        num_accepted: replicas that accepted it.
        num_targets: replicas it was sent to (the closest nodes found).
        hops: depth of the lookup that found the replicas.
        reason: why nothing accepted it ("" when ok).
    """

    ok: bool
    num_accepted: int
    num_targets: int
    hops: int
    reason: str = ""


@dataclass(frozen=True)
class GetOutcome:
    """How a get went: the value (None if not found) and where it came from.

    ``source`` is "cache" (a recent read), "local" (this node is a replica), "network" (a
    lookup; ``hops`` is its depth) or "none" (nothing found; ``reason`` says whether the key
    holds nothing or the network failed). ``num_answered``: the nodes of the lookup that
    answered (0 of ``num_queried``: the value, if any, is this node's own replica).
    """

    value: ValueWithExpiration | None
    source: Literal["cache", "local", "network", "none"]
    hops: int = 0
    num_queried: int = 0
    reason: str = ""
    num_answered: int = 0
