"""hivemind's pieces that both hivemind modules share: the lazy import, the wire formats, and
the trainer's StepHook that drives hivemind.Optimizer and attributes its time to our phases.

The attribution (hivemind 1.1.12, pinned by the ``[hivemind]`` extra) is described in
:mod:`peer.hivemind.backend`. It wraps two or three of the optimizer's methods on the instance
(hivemind calls them through ``self``); the pin keeps their names and meaning fixed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from averaging.result import RoundResult
from dht.errors import ConfigError
from peer.profiling.phases import PhaseClock
from peer.swarm.round import EpochStats
from peer.train.trainer import StepContext

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
# How long a peer's "joined" record outlives its wait for the others, in seconds.
JOINED_TTL_S = 60.0
# Seconds between two looks at the joined records while waiting for the others.
JOIN_POLL_S = 0.5
# Bytes of a libp2p peer id's tail that name the peer on the dashboard (see swarm_peer_id).
PEER_ID_TAIL_BYTES = 32


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


def swarm_peer_id(peer_id: Any) -> str:
    """The name of a hivemind peer in our records and on the dashboard.

    ``peer_id`` is a libp2p ``PeerID`` or its bytes. Its base58 form always starts with the same
    eight characters (``12D3KooW`` for Ed25519 keys), which is all a dashboard shows of an id, so
    this is the hex of its last 32 bytes instead: for an Ed25519 id, the raw public key, the form
    of a native peer id.
    """
    raw = peer_id if isinstance(peer_id, bytes) else peer_id.to_bytes()
    return raw[-PEER_ID_TAIL_BYTES:].hex()


def dht_time() -> float:
    """hivemind's DHT time (the clock of its records' timestamps and expirations)."""
    from hivemind.utils import get_dht_time

    return get_dht_time()


def butterfly_bytes(num_values: int, num_peers: int, bytes_per_value: float) -> int:
    """Bytes one peer sends (and receives) in a butterfly all-reduce of ``num_peers``."""
    return int(2 * (num_peers - 1) / num_peers * num_values * bytes_per_value)


class EstimatedCounters:
    """Byte counters for the metrics stream, estimated per all-reduce (see the module doc)."""

    def __init__(self) -> None:
        self.sent = 0
        self.recv = 0

    def median_rtt_s(self, since_s: float) -> float | None:
        """None: hivemind does not say how long its libp2p requests take (no ``rtt_ms``)."""
        return None

    def add_round(self, num_values: int, num_peers: int, bytes_per_value: float) -> None:
        one_way = butterfly_bytes(num_values, num_peers, bytes_per_value)
        self.sent += one_way
        self.recv += one_way


class AllreduceWatch:
    """Polls a round's StepControl from a helper thread and notes when its all-reduce begins.

    With ``leave`` set (the peer is stopping) before the all-reduce began, it cancels the round,
    as hivemind's own shutdown cancels a round that is still looking for a group: otherwise
    the training thread could wait out the whole ``--averaging-timeout`` before it stops.
    """

    def __init__(self, control: Any, *, leave: threading.Event | None = None):
        self._control = control
        self._leave = leave
        self._stop = threading.Event()
        self.began_s: float | None = time.perf_counter() if control.began_allreduce else None
        self._thread = threading.Thread(target=self._poll, name="vp-hm-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        cancelled = False
        while self.began_s is None and not self._stop.wait(ALLREDUCE_POLL_S):
            if self._control.began_allreduce:
                self.began_s = time.perf_counter()
            elif not cancelled and self._leave is not None and self._leave.is_set():
                cancelled = True
                self._control.cancel()  # hivemind then steps on the local gradients

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
        on_round: called in the training thread with every epoch transition as a round result
            and the group's size (hivemind does not name a parameter round's members); see
            :meth:`_timed_update_epoch`.
        leave: set when the peer stops: a round still looking for a group is cancelled.
    """

    def __init__(
        self,
        opt: Any,
        clock: PhaseClock,
        *,
        compression: str,
        counters: EstimatedCounters,
        on_round: Callable[[RoundResult, int], None] | None = None,
        leave: threading.Event | None = None,
    ):
        self.opt = opt
        self.clock = clock
        self.stats = EpochStats()
        self.counters = counters
        self.on_round = on_round
        self.leave = leave
        self._bytes_per_value = BYTES_PER_VALUE[compression]
        self._num_values = sum(p.numel() for g in opt.param_groups for p in g["params"])
        self._round: RoundResult | None = None  # the gradient round of the epoch transition
        # hivemind calls these through ``self``: instance attributes take precedence
        self._average = opt._average_gradients_and_load_into_optimizer
        opt._average_gradients_and_load_into_optimizer = self._timed_average
        self._load_state = opt.load_state_from_peers
        opt.load_state_from_peers = self._timed_load_state
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
        watch = None if control is None else AllreduceWatch(control, leave=self.leave)
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
        self._round = self._gradient_round(control, end - start - allreduce_s, allreduce_s)
        self.stats.add(self._round)
        if self._round.ok:
            self.counters.add_round(self._num_values, self._round.num_peers, self._bytes_per_value)

    def _gradient_round(
        self, control: Any, matchmaking_s: float, allreduce_s: float
    ) -> RoundResult:
        times = dict(
            matchmaking_s=matchmaking_s, allreduce_s=allreduce_s, epoch=self.opt.local_epoch
        )
        if control.cancelled():
            return RoundResult("failed", "cancelled: the peer is leaving", **times)
        if not control.done():
            return RoundResult("failed", "no result within averaging_timeout", **times)
        if control.exception() is not None:
            return RoundResult("failed", repr(control.exception()), **times)
        members = tuple(swarm_peer_id(peer_id) for peer_id in control.result())
        one_way = butterfly_bytes(self._num_values, len(members), self._bytes_per_value)
        return RoundResult(
            "ok" if len(members) > 1 else "alone",
            members=members,
            bytes_sent=one_way,
            bytes_received=one_way,
            averaged_fraction=1.0 if len(members) > 1 else 0.0,
            **times,
        )

    def _timed_update_epoch(self, *args: Any, **kwargs: Any) -> None:
        """hivemind's epoch transition: one round entry for ``on_round``.

        With gradient averaging, the entry of the round :meth:`_timed_average` saw, or ``alone``
        when hivemind started none (no other peer, or it could not start one: it then steps on
        the local gradients). With local updates, the whole parameter round is ``matchmaking``
        and hivemind reports neither its group nor its outcome: the entry is ``ok`` with the
        swarm's size as the group's when other peers were there.
        """
        epoch, start = self.opt.local_epoch, time.perf_counter()
        num_peers = self.opt.tracker.global_progress.num_peers
        self._round = None
        if self.opt.use_local_updates:
            with self.clock.phase("matchmaking"):
                self._update_epoch(*args, **kwargs)
        else:
            self._update_epoch(*args, **kwargs)
        result, self._round = self._round, None
        group_size = result.num_peers if result is not None else 1
        if result is None and self.opt.use_local_updates and num_peers > 1:
            result = RoundResult(
                "ok",
                matchmaking_s=time.perf_counter() - start,
                averaged_fraction=1.0,
                epoch=epoch,
            )
            group_size = num_peers
        if result is None:
            reason = f"no round started ({num_peers} peers in its view)"
            result = RoundResult("alone", reason, epoch=epoch)
        if self.opt.use_local_updates:
            self.stats.add(result)
        if self.on_round is not None:
            self.on_round(result, group_size)

    def _timed_load_state(self, **kwargs: Any) -> None:
        with self.clock.phase("state_sync"):
            self._load_state(**kwargs)


_sigterm_reset_registered = False


def children_take_sigterm() -> None:
    """Forked children (hivemind's DHT and averager processes) get SIGTERM's default action back.

    ``peer join`` handles SIGTERM by asking training to stop; a child forked after that would
    inherit the handler, so when hivemind's shutdown gives up on a process (after its grace
    period) and terminates it, nothing happened: the process lived on until its own shutdown
    finished, and the peer's exit waited for it (about 5 s more). SIGINT stays: hivemind's
    children ignore it.
    """
    global _sigterm_reset_registered
    if not _sigterm_reset_registered:
        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
        _sigterm_reset_registered = True


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


def wait_for_peers(
    dht: Any,
    key: str,
    *,
    peer_id: str,
    wanted: int,
    timeout_s: float,
    stop_event: threading.Event,
) -> None:
    """Block until ``wanted`` peers (this one included) have joined the run, ``timeout_s`` at
    most (then a warning) or until ``stop_event``.

    hivemind publishes a peer's progress only once it has accumulated samples, so the peers
    announce themselves under a key of their own (``{run_id}_vp_joined``, one subkey each).
    """
    expiration_s = dht_time() + timeout_s + JOINED_TTL_S
    deadline = time.monotonic() + timeout_s
    while not stop_event.is_set():
        joined = joined_peers(dht, key)
        if peer_id not in joined:
            # (again) until it is seen: a store that timed out on a loaded machine is retried
            future = dht.store(key, True, expiration_s, subkey=peer_id, return_future=True)
            try:
                future.result(timeout=READ_TIMEOUT_S)
            except Exception as e:  # the next poll stores again
                logger.debug("could not store %s: %r", key, e)
        if len(joined) >= wanted:
            return
        if time.monotonic() >= deadline:
            logger.warning(
                "only %d of %d peers after %.0f s; training anyway", len(joined), wanted, timeout_s
            )
            return
        stop_event.wait(JOIN_POLL_S)


class HivemindBootstrap:
    """A hivemind.DHT node for others to join (``peer demo`` / ``peer bench train``).

    A context manager; :attr:`address` is its first multiaddr. hivemind.DHT forks its process
    at start: create it before starting threads whose locks the child must not inherit.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.dht = import_hivemind().DHT(host_maddrs=listen_maddrs(host, 0), start=True)
        self.address = str(self.dht.get_visible_maddrs()[0])

    def __enter__(self) -> HivemindBootstrap:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the node; safe to call twice."""
        dht, self.dht = self.dht, None
        if dht is not None:
            dht.shutdown()
