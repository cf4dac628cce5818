"""hivemind's pieces that both hivemind modules share: the lazy import, the wire formats, and
the trainer's StepHook that drives hivemind.Optimizer and attributes its time to our phases.

The attribution (hivemind 1.1.12, pinned by the ``[hivemind]`` extra) is described in
:mod:`peer.hivemind_backend`. It wraps two or three of the optimizer's methods on the instance
(hivemind calls them through ``self``); the pin keeps their names and meaning fixed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np

from dht.errors import ConfigError
from peer.phases import PhaseClock
from peer.trainer import StepContext

logger = logging.getLogger(__name__)
# Bound on one read of a record from hivemind's DHT, in seconds.
READ_TIMEOUT_S = 10.0
HIVEMIND_MISSING = (
    "the hivemind backend needs the [hivemind] extra: pip install 'volunteer-peer[hivemind]' "
    "(keep your torch: add -c <(echo torch==$(python -c 'import torch; print(torch.__version__)')))"
)
# Seconds between two looks at a round's StepControl while the training thread waits for it.
ALLREDUCE_POLL_S = 0.001
BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "uint8": 1.0}


def import_hivemind() -> Any:
    """The ``hivemind`` module.

    Raises:
        ConfigError: the ``[hivemind]`` extra is not installed (one line saying how to get it).
    """
    try:
        import hivemind
    except ImportError as e:
        raise ConfigError(f"{HIVEMIND_MISSING} ({e})") from None
    return hivemind


def hivemind_compression(name: str) -> Any:
    """hivemind's closest equivalent of our wire format ``name``.

    ``uint8`` maps to ``Uniform8BitQuantization`` (one 256-value codebook per tensor part,
    +-3 sigma): hivemind's blockwise 8-bit format needs bitsandbytes, which the extra leaves out.

    Raises:
        ConfigError: an unknown name, or ``uint8`` where hivemind cannot decode it (NumPy 2).
    """
    compression = import_hivemind().compression
    if name == "uint8" and int(np.__version__.split(".")[0]) >= 2:
        # its decoder calls int() on a 1-element array, which NumPy 2 refuses: every received
        # part would be dropped and the "averaged" tensors would stay mostly local
        raise ConfigError(
            "--compression uint8: hivemind 1.1.12's 8-bit decoder fails under NumPy "
            f"{np.__version__} (needs NumPy 1.x); use fp16 or none with --backend hivemind"
        )
    table = {
        "none": compression.NoCompression,
        "fp16": compression.Float16Compression,
        "uint8": compression.Uniform8BitQuantization,
    }
    try:
        return table[name]()
    except KeyError:
        raise ConfigError(f"--compression: {name!r} is not one of {', '.join(table)}") from None


class EstimatedCounters:
    """Byte counters for the metrics stream, estimated per all-reduce (see the module doc)."""

    def __init__(self) -> None:
        self.sent = 0
        self.recv = 0

    def add_round(self, num_values: int, num_peers: int, bytes_per_value: float) -> None:
        one_way = int(2 * (num_peers - 1) / num_peers * num_values * bytes_per_value)
        self.sent += one_way
        self.recv += one_way


@dataclasses.dataclass
class RoundStats:
    """Counters of the gradient / parameter rounds this peer waited for."""

    num_rounds: int = 0
    num_failed_rounds: int = 0
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0


class AllreduceWatch:
    """Polls a round's StepControl from a helper thread and notes when its all-reduce begins."""

    def __init__(self, control: Any):
        self._control = control
        self._stop = threading.Event()
        self.began_s: float | None = time.perf_counter() if control.began_allreduce else None
        self._thread = threading.Thread(target=self._poll, name="vp-hm-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while self.began_s is None and not self._stop.wait(ALLREDUCE_POLL_S):
            if self._control.began_allreduce:
                self.began_s = time.perf_counter()

    def stop(self) -> float | None:
        """Stop polling; the ``time.perf_counter`` at which the all-reduce began, or None."""
        self._stop.set()
        self._thread.join()
        return self.began_s


class HivemindHook:
    """The trainer's StepHook: one ``hivemind.Optimizer.step`` per local step, profiled.

    Args:
        opt: the hivemind.Optimizer (built over the trainer's model and local optimizer).
        clock: the trainer's phase clock.
        compression: our name of the gradient wire format (for the byte estimate).
        counters: where the estimated bytes go.
    """

    def __init__(
        self, opt: Any, clock: PhaseClock, *, compression: str, counters: EstimatedCounters
    ):
        self.opt = opt
        self.clock = clock
        self.stats = RoundStats()
        self.counters = counters
        self._bytes_per_value = BYTES_PER_VALUE[compression]
        self._num_values = sum(p.numel() for g in opt.param_groups for p in g["params"])
        # hivemind calls these through ``self``: instance attributes take precedence
        self._average = opt._average_gradients_and_load_into_optimizer
        opt._average_gradients_and_load_into_optimizer = self._timed_average
        self._load_state = opt.load_state_from_peers
        opt.load_state_from_peers = self._timed_load_state
        if opt.use_local_updates:
            self._update_epoch = opt._update_global_epoch
            opt._update_global_epoch = self._timed_update_epoch

    @property
    def epoch(self) -> int:
        return self.opt.local_epoch

    def on_step(self, context: StepContext) -> None:
        self.opt.step(batch_size=context.batch_samples)
        self.opt.zero_grad(set_to_none=True)

    def _timed_average(self, control: Any) -> None:
        start = time.perf_counter()
        watch = None if control is None else AllreduceWatch(control)
        with self.clock.phase("matchmaking"):
            try:
                self._average(control)
            finally:
                began_s = watch.stop() if watch is not None else None
        end = time.perf_counter()
        allreduce_s = 0.0 if began_s is None else end - max(began_s, start)
        self.clock.transfer(allreduce_s, "matchmaking", "allreduce")
        if control is None:
            return  # hivemind skipped the round: no other peer
        self.stats.num_rounds += 1
        self.stats.matchmaking_s += end - start - allreduce_s
        self.stats.allreduce_s += allreduce_s
        if control.done() and control.exception() is None:
            self.counters.add_round(self._num_values, len(control.result()), self._bytes_per_value)
        else:
            self.stats.num_failed_rounds += 1

    def _timed_update_epoch(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        with self.clock.phase("matchmaking"):
            self._update_epoch(*args, **kwargs)
        self.stats.num_rounds += 1
        self.stats.matchmaking_s += time.perf_counter() - start

    def _timed_load_state(self, **kwargs: Any) -> None:
        with self.clock.phase("state_sync"):
            self._load_state(**kwargs)


def listen_maddrs(host: str, port: int) -> list[str]:
    """libp2p multiaddrs for ``--host``/``--port``."""
    family = "ip6" if ":" in host else "ip4"
    return [f"/{family}/{host}/tcp/{port}"]


def joined_peers(dht: Any, key: str) -> list[str]:
    """The peers that announced themselves under ``key`` (blocking; empty on a failed read)."""
    try:
        found = dht.get(key, latest=True, return_future=True).result(timeout=READ_TIMEOUT_S)
    except Exception as e:  # a slow or failed read is an empty view: the caller polls again
        logger.debug("could not read %s: %r", key, e)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    return [str(subkey) for subkey in found.value]


def progress_records(dht: Any, run_id: str) -> list[dict[str, Any]]:
    """The live progress records hivemind.Optimizer peers of ``run_id`` publish (blocking).

    Each is a dict of hivemind's LocalTrainingProgress: ``peer_id`` (bytes), ``epoch``,
    ``samples_accumulated``, ``samples_per_second``, ``time``, ``client_mode``.
    """
    try:
        found = dht.get(f"{run_id}_progress", latest=True, return_future=True).result(
            timeout=READ_TIMEOUT_S
        )
    except Exception as e:  # a slow or failed read is an empty view, not a crash of the caller
        logger.debug("could not read %s_progress: %r", run_id, e)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for item in found.value.values():
        value = getattr(item, "value", None)
        if isinstance(value, dict) and "epoch" in value:  # a peer that left stores None
            records.append(value)
    return records


class HivemindBootstrap:
    """A hivemind.DHT node for others to join (``peer demo`` / ``peer bench train``).

    A context manager; :attr:`address` is its first multiaddr. hivemind.DHT forks its process
    at start: create it before starting threads whose locks the child must not inherit.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.dht = import_hivemind().DHT(host_maddrs=listen_maddrs(host, 0), start=True)
        self.address = str(self.dht.get_visible_maddrs()[0])
        self._validated: set[str] = set()

    def __enter__(self) -> HivemindBootstrap:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def records(self, run_id: str) -> list[dict[str, Any]]:
        """See :func:`progress_records`."""
        if run_id not in self._validated:
            # the records are signed and schema-checked: without hivemind.Optimizer's validators
            # this node could not even decode them
            from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
            from hivemind.optim.progress_tracker import TrainingProgressSchema

            self.dht.add_validators(
                [RSASignatureValidator(), SchemaValidator(TrainingProgressSchema, prefix=run_id)]
            )
            self._validated.add(run_id)
        return progress_records(self.dht, run_id)

    def close(self) -> None:
        """Stop the node; safe to call twice."""
        dht, self.dht = self.dht, None
        if dht is not None:
            dht.shutdown()
