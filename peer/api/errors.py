"""Arguments of ``hivemind.DHT`` and ``hivemind.Optimizer`` that have no equivalent here.

A script written for hivemind keeps working when it passes such an argument at its hivemind
default (the behaviour is the same); any other value raises a :class:`TypeError` that names the
argument and says what to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_ANY = object()  # every value is accepted: the argument only tunes something done differently


def _is_hivemind_no_compression(value: Any) -> bool:
    return type(value).__name__ == "NoCompression"


# name -> (values accepted as "the same behaviour", what to use instead)
UNSUPPORTED_OPTIMIZER: dict[str, tuple[tuple[Any, ...], str]] = {
    "allreduce_timeout": ((None,), "averaging_timeout= (bounds the whole round)"),
    "next_chunk_timeout": ((None,), "nothing: the transport bounds every chunk wait (30 s)"),
    "offload_optimizer": (
        (None, False),
        "nothing: the optimizer steps where the parameters are (keep them on the CPU to offload)",
    ),
    "delay_grad_averaging": (
        (False,),
        "delay_optimizer_step=True, which overlaps both the averaging and the optimizer step "
        "with the next epoch (delayed parameter updates)",
    ),
    "delay_state_averaging": ((_ANY,), ""),
    "average_state_every": ((1,), "nothing: parameters are averaged every epoch in 'params' mode"),
    "auxiliary": ((False,), "nothing: a peer in client_mode=True still contributes its data"),
    "grad_averager_factory": ((None,), "mode='grad' | 'params' | 'diloco'"),
    "average_opt_statistics": (((), []), "nothing: optimizer statistics stay local"),
    "extra_tensors": (((), []), "nothing: only parameters and optimizer state are shared"),
    "averager_opts": (
        (None, {}),
        "our keyword arguments: target_group_size=, min_group_size=, matchmaking_time=",
    ),
    "tracker_opts": ((None, {}), "publish_interval= (seconds between progress records)"),
    "performance_ema_alpha": ((0.1,), "nothing: rates are measured between progress records"),
}

UNSUPPORTED_DHT: dict[str, tuple[tuple[Any, ...], str]] = {
    "p2p": ((None,), "nothing: every peer serves HTTP itself (host=, port=)"),
    "daemon": ((True, False), ""),
    "num_workers": ((_ANY,), ""),
    "record_validators": (((), []), "nothing: records are signed by their writer's identity"),
    "shutdown_timeout": ((_ANY,), ""),
    "await_ready": ((True,), "nothing: peer.DHT returns once it has joined"),
    "use_ipfs": ((False,), "initial_peers= with the URL of a peer of the swarm"),
    "use_relay": ((_ANY,), ""),
    "use_auto_relay": ((False,), "client_mode=True behind a NAT"),
}


def _accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    if _ANY in accepted:
        return True
    if _is_hivemind_no_compression(value) and None in accepted:
        return True
    return any(value is a or (type(value) is type(a) and value == a) for a in accepted)


def reject_unsupported(
    owner: str, kwargs: Mapping[str, Any], table: Mapping[str, tuple[tuple[Any, ...], str]]
) -> None:
    """Raise for the first argument of ``kwargs`` that is unknown, or that hivemind has and we do
    not with a value other than hivemind's behaviour here.

    Raises:
        TypeError: naming the argument (and what to use instead, when there is something).
    """
    for name, value in kwargs.items():
        if name not in table:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        accepted, instead = table[name]
        if not _accepted(value, accepted):
            raise TypeError(
                f"{owner}(): hivemind's argument {name}={value!r} is not supported here; "
                f"use {instead}"
            )
