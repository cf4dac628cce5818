"""Arguments of ``hivemind.DHT`` and ``hivemind.Optimizer`` 1.1.12 with no exact equivalent here.

A script written for hivemind keeps running when it passes one: at hivemind's default nothing
is said (the behaviour is the same); at another value one INFO line says what is done here
instead. Only values whose effect is not given here, so that ignoring them would change the
result (a custom gradient averager, averaged optimizer statistics, record validators, ...), raise
a :class:`TypeError` that names the argument and says what to use. An argument hivemind does
not have either is a :class:`TypeError` too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def _never(value: Any) -> bool:
    return False


def _truthy(value: Any) -> bool:
    return bool(value)


def _not_none(value: Any) -> bool:
    return value is not None


@dataclass(frozen=True)
class HivemindOption:
    """A hivemind argument with no exact equivalent here.

    Attributes:
        default: hivemind's default (passing it says nothing new).
        instead: what is done here instead (the INFO line, or the TypeError's advice).
        refused: values whose effect is not given here (a TypeError).
    """

    default: Any
    instead: str
    refused: Callable[[Any], bool] = field(default=_never)


def _is_default(value: Any, default: Any) -> bool:
    if type(value).__name__ == "NoCompression" and default is None:
        return True
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except (TypeError, ValueError, RuntimeError):  # tensors and such compare elementwise
        return False


def check_hivemind_options(
    owner: str, kwargs: Mapping[str, Any], table: Mapping[str, HivemindOption]
) -> None:
    """Accept hivemind's arguments of ``kwargs`` (one INFO line each at a non-default value).

    Raises:
        TypeError: an argument hivemind does not have either, or a refused value (naming it
            and what to use instead).
    """
    for name, value in kwargs.items():
        option = table.get(name)
        if option is None:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        if option.refused(value):
            raise TypeError(
                f"{owner}(): hivemind's argument {name}={value!r} is not supported here "
                f"(ignoring it would change the result); use {option.instead}"
            )
        if not _is_default(value, option.default):
            logger.info(
                "%s: hivemind's %s=%r has no effect here: %s", owner, name, value, option.instead
            )


_O = HivemindOption
OPTIMIZER_OPTIONS: dict[str, HivemindOption] = {
    "allreduce_timeout": _O(None, "averaging_timeout bounds the whole round"),
    "next_chunk_timeout": _O(None, "the transport bounds every chunk wait (30 s)"),
    "offload_optimizer": _O(None, "the optimizer steps where the parameters are"),
    "delay_state_averaging": _O(True, "state averaging (params mode) runs within step()"),
    "average_state_every": _O(
        1, "parameters are averaged every epoch (params mode)", lambda v: v != 1
    ),
    "auxiliary": _O(False, "client_mode=True (a peer that still trains)", _truthy),
    "grad_averager_factory": _O(None, "mode='grad' | 'params' | 'diloco'", _not_none),
    "average_opt_statistics": _O((), "nothing: optimizer statistics stay local", _truthy),
    "extra_tensors": _O((), "nothing: only parameters and optimizer state are shared", _truthy),
    "performance_ema_alpha": _O(0.1, "rates are measured between progress records"),
}

# hivemind.optim.progress_tracker.ProgressTracker's arguments a script passes in tracker_opts
TRACKER_OPTIONS: dict[str, HivemindOption] = {
    name: _O(
        default,
        "progress is published every publish_interval= s (default 2 s) and read on that cadence",
    )
    for name, default in (
        ("min_refresh_period", 0.5),
        ("max_refresh_period", 10),
        ("default_refresh_period", 3),
        ("expected_drift_peers", 3),
        ("expected_drift_rate", 0.2),
        ("metadata_expiration", 60.0),
    )
} | {
    "performance_ema_alpha": _O(0.1, "rates are measured between progress records"),
    "private_key": _O(None, "records are signed with the DHT's Ed25519 identity"),
    "status_loglevel": _O(logging.DEBUG, "verbose=True logs one INFO line per epoch"),
    "daemon": _O(True, "the tracker runs on the DHT's event-loop thread"),
    "client_mode": _O(None, "client_mode= of peer.DHT"),
}

# hivemind's DecentralizedAverager arguments a script passes in averager_opts (those that are
# ours too, target_group_size and min_group_size, are taken as ours before this table)
AVERAGER_OPTIONS: dict[str, HivemindOption] = {
    "initial_group_bits": _O("", "groups form by matchmaking on the DHT, without group bits"),
    "min_matchmaking_time": _O(5.0, "matchmaking_time= bounds the search for a group"),
    "request_timeout": _O(3.0, "each request is bounded by the transport's request timeout"),
    "averaging_alpha": _O(1.0, "the group's average replaces the local tensors", lambda v: v != 1),
    "part_size_bytes": _O(2**19, "parts are sized by the all-reduce (see ARCHITECTURE)"),
    "allreduce_timeout": _O(None, "averaging_timeout= bounds the whole round"),
    "next_chunk_timeout": _O(None, "the transport bounds every chunk wait (30 s)"),
    "sender_timeout": _O(None, "deadlines are measured per round (ARCHITECTURE, Deadlines)"),
    "reducer_timeout": _O(None, "deadlines are measured per round (ARCHITECTURE, Deadlines)"),
    "compression": _O(None, "grad_compression= sets the one wire format of rounds"),
    "state_compression": _O(None, "load_state_compression= sets the download format"),
    "tensor_infos": _O(None, "tensors are described by their shapes and dtypes"),
    "bandwidth": _O(None, "parts are split evenly among the group's peers"),
    "min_vector_size": _O(0, "parts are sized by the all-reduce"),
    "auxiliary": _O(False, "client_mode=True (a peer that still trains)", _truthy),
    "allow_state_sharing": _O(None, "every peer that serves shares its state"),
    "declare_state_period": _O(30, "the state is announced at every epoch"),
    "client_mode": _O(None, "client_mode= of peer.DHT"),
    "daemon": _O(True, "the averager runs on the DHT's event-loop thread"),
    "shutdown_timeout": _O(5, "shutdown_timeout= of peer.Optimizer"),
    "status_loglevel": _O(logging.DEBUG, "verbose=True logs one INFO line per epoch"),
    "offload_optimizer": _O(False, "the optimizer steps where the parameters are"),
    "reuse_tensors": _O(False, "the averaged buffers are allocated once"),
    "sync_epoch_when_averaging": _O(False, "peers agree on the epoch through progress records"),
    "delta_rule_averaging": _O(False, "params mode averages the parameters themselves"),
}

_FREE = "every peer serves HTTP itself"
DHT_OPTIONS: dict[str, HivemindOption] = {
    # hivemind.DHT
    "p2p": _O(None, f"nothing: {_FREE} (host=, port=)"),
    "daemon": _O(True, "the DHT runs on an event-loop thread of this process"),
    "num_workers": _O(4, "lookups ask alpha=3 peers at once"),
    "record_validators": _O(
        (), "nothing: records under owner subkeys are signed by their writer", _truthy
    ),
    "shutdown_timeout": _O(3, "shutdown() waits for the loop thread to leave"),
    # hivemind.dht.node.DHTNode.create
    "node_id": _O(None, "the node id derives from the peer's Ed25519 identity"),
    "depth_modulo": _O(5, "buckets split as Kademlia's do"),
    "parallel_rpc": _O(None, "lookups ask alpha=3 peers at once"),
    "refresh_timeout": _O(None, "buckets are refreshed every 600 s"),
    "bootstrap_timeout": _O(None, "joining waits for the initial peers within 10 s"),
    "cache_locally": _O(True, "reads are cached for 30 s"),
    "cache_nearest": _O(1, "values are kept on their replicas only"),
    "cache_refresh_before_expiry": _O(5, "cached reads expire after 30 s"),
    "cache_on_store": _O(True, "a store invalidates the cached read of its key"),
    "reuse_get_requests": _O(True, "concurrent gets run their own lookups"),
    "chunk_size": _O(16, "requests are sent one key at a time"),
    "blacklist_time": _O(5.0, "unresponsive peers leave the routing table by liveness checks"),
    "backoff_rate": _O(2.0, "unresponsive peers leave the routing table by liveness checks"),
    "record_validator": _O(
        None, "records under owner subkeys are signed by their writer", _not_none
    ),
    "authorizer": _O(
        None, "swarm_key= (a private swarm: every request is authenticated)", _not_none
    ),
    "ensure_bootstrap_success": _O(True, "joining raises when no initial peer answers"),
    "strict": _O(True, "a bad record is refused, never fatal"),
    # hivemind.p2p.P2P.create
    "auto_nat": _O(True, "the initial peers dial this peer back to find whether it is reachable"),
    "conn_manager": _O(True, "connections are capped per address and in total"),
    "dht_mode": _O("server", "client_mode=True for a peer that serves nothing"),
    "force_reachability": _O(None, "reachability is checked by dial-backs"),
    "idle_timeout": _O(30, "idle connections close after 30 s"),
    "relay_hop_limit": _O(0, "relayed traffic is capped by max_relayed_bytes_per_s="),
    "startup_timeout": _O(15, "starting is bounded by 60 s"),
    "tls": _O(True, "requests are authenticated per session; see docs/SECURITY.md"),
    "use_auto_relay": _O(False, "a peer nobody can dial is relayed by an initial peer"),
    "use_ipfs": _O(False, "initial_peers= with the URL of a peer of the swarm", _truthy),
    "persistent_conn_max_msg_size": _O(2**30, "bodies are capped by the transport's limits"),
    "quic": _O(None, f"{_FREE} over TCP"),
    "use_relay_discovery": _O(None, "relays are found among the initial peers"),
    "check_if_identity_free": _O(True, "the identity is the peer's key; it may run once"),
    "trusted_relays": _O(None, "relay_via= to be reached through given relays"),
}
