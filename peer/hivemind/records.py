"""What hivemind peers publish for the dashboard besides hivemind's own progress record.

hivemind.DHT dictionaries per run, one subkey per peer (the reader is
:mod:`peer.hivemind.swarm`):

* ``{run}_progress``: hivemind.Optimizer's own progress record (its ``LocalTrainingProgress``:
  peer id bytes, epoch, samples accumulated, samples/s, time, client mode). hivemind stores it
  again only when the peer's epoch changes or half its expiration (30 s) passed, so on its own it
  shows peers as silent and behind;
* ``{run}_vp_progress``: the fields of our native progress record (``peer_id`` bytes, ``epoch``,
  ``samples``, ``samples_per_s``, ``time``, ``address``, ``client_mode``) with hivemind's epoch
  and samples, stored every ``--publish-interval`` like a native peer's. The rate means what the
  native one means, how fast samples accumulate within an epoch (the seconds the trainer waited
  for rounds left out), smoothed over a few seconds: hivemind's own estimate starts again from
  zero at every epoch;
* ``{run}_vp_profile``: our :class:`peer.records.profile.ProfileRecord` (its wire form);
* ``{run}_vp_rounds``: our :class:`peer.swarm.round_log.RoundLogRecord` (its wire form).

A peer writes all of them under the owner marker of its process-wide RSA key, the one hivemind's
ProgressTracker signs the progress record with: hivemind's ``RSASignatureValidator`` signs them,
and replicas and readers check the signature, so nobody else can change a peer's records.
hivemind is imported lazily.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from peer.hivemind.hook import READ_TIMEOUT_S, dht_time, swarm_peer_id
from peer.records.profile import ProfileRecord
from peer.records.rounds import RoundEntry, RoundLogRecord

logger = logging.getLogger(__name__)
# Bound on one store of a record, in seconds (the next period stores again).
STORE_TIMEOUT_S = READ_TIMEOUT_S
# A progress record outlives this many publishing periods (at least MIN_PROGRESS_TTL_S seconds).
PROGRESS_TTL_PERIODS = 4
MIN_PROGRESS_TTL_S = 10.0
# A profile record outlives this many profile periods (at least MIN_PROFILE_TTL_S seconds).
PROFILE_TTL_PERIODS = 4
MIN_PROFILE_TTL_S = 20.0
# A round record expires this long after it was stored (at least), in seconds; an unchanged one
# is stored again after a third of it.
MIN_ROUNDS_TTL_S = 60.0
# The published rate follows a change within about this many seconds.
RATE_SMOOTHING_S = 2.0


def progress_key(run_id: str) -> str:
    """hivemind.Optimizer's own progress key of ``run_id``."""
    return f"{run_id}_progress"


def vp_progress_key(run_id: str) -> str:
    """The key of our progress records of a hivemind run."""
    return f"{run_id}_vp_progress"


def profile_key(run_id: str) -> str:
    """The key of the profile records of a hivemind run."""
    return f"{run_id}_vp_profile"


def rounds_key(run_id: str) -> str:
    """The key of the round records of a hivemind run."""
    return f"{run_id}_vp_rounds"


class LocalProgress(NamedTuple):
    """Where a peer is: its epoch and the samples it accumulated toward it (hivemind's numbers),
    the samples it trained on and the seconds it waited for rounds since it started."""

    epoch: int
    samples: int
    total_samples: int
    round_s: float


# ---- publishing --------------------------------------------------------------------------------


class HivemindRecordPublisher:
    """Publishes one peer's progress, profile and round records from a thread of its own.

    Every ``interval_s`` a fresh progress record, and the round record if it changed (or a third
    of its TTL passed); every ``profile_interval_s`` a fresh profile record. A failed store is
    logged and retried at the next period: publishing never stops the peer. :meth:`close` (safe
    twice) stops the thread; call it before the DHT shuts down.

    Args:
        dht: the peer's hivemind.DHT.
        run_id: the run (the keys' prefix).
        libp2p_id: the peer's libp2p id, as bytes (its name in the records).
        make_profile: the profile record for a DHT time (unix seconds).
        progress: where the peer is now (read from this thread: must be quick).
        target_batch_size: samples per swarm epoch (published, so that readers know it).
        address: the peer's multiaddr (None in client mode).
        client_mode: whether the peer accepts no connections.
        interval_s: seconds between two progress records.
        profile_interval_s: seconds between two profile records.
        max_rounds: rounds kept and published.
    """

    def __init__(
        self,
        dht: Any,
        *,
        run_id: str,
        libp2p_id: bytes,
        make_profile: Callable[[float], ProfileRecord],
        progress: Callable[[], LocalProgress],
        target_batch_size: int,
        address: str | None,
        client_mode: bool,
        interval_s: float,
        profile_interval_s: float,
        max_rounds: int = 10,
    ):
        from hivemind.dht.schema import RSASignatureValidator

        validator = RSASignatureValidator()  # the process-wide key, as hivemind's tracker's
        dht.add_validators([validator])  # merged with the tracker's one if it is there
        self.dht = dht
        self.run_id = run_id
        self.libp2p_id = libp2p_id
        self.peer_id = swarm_peer_id(libp2p_id)
        self.subkey = validator.local_public_key
        self.make_profile = make_profile
        self.progress = progress
        self.target_batch_size = target_batch_size
        self.address = address
        self.client_mode = client_mode
        self.interval_s = interval_s
        self.profile_interval_s = profile_interval_s
        self.progress_ttl_s = max(PROGRESS_TTL_PERIODS * interval_s, MIN_PROGRESS_TTL_S)
        self.profile_ttl_s = max(PROFILE_TTL_PERIODS * profile_interval_s, MIN_PROFILE_TTL_S)
        self.rounds_ttl_s = max(10 * interval_s, MIN_ROUNDS_TTL_S)
        self._rate_from: tuple[float, int, float] | None = None  # monotonic s, samples, round s
        self._samples_per_s = 0.0
        self._lock = threading.Lock()
        self._rounds: collections.deque[RoundEntry] = collections.deque(maxlen=max_rounds)
        self._counts = (0, 0, 0)  # rounds, failed, local steps
        self._version = 0
        self._published: tuple[int, int, float] | None = None  # version, epoch, monotonic s
        self._stop = threading.Event()
        self._profiles_stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def add_round(self, entry: RoundEntry) -> None:
        """Record a finished round (any thread)."""
        with self._lock:
            self._rounds.append(entry)
            rounds, failed, local = self._counts
            self._counts = (
                rounds + 1,
                failed + (entry.status == "failed"),
                local + entry.local_fallback,
            )
            self._version += 1

    def rounds_record(self) -> RoundLogRecord:
        """What the next round record says."""
        with self._lock:
            rounds, failed, local = self._counts
            return RoundLogRecord(
                peer_id=self.peer_id,
                time=dht_time(),
                epoch=self.progress().epoch,
                target_batch_size=self.target_batch_size,
                num_rounds=rounds,
                num_failed_rounds=failed,
                num_local_steps=local,
                rounds=tuple(self._rounds),
            )

    def _store(self, key: str, value: dict, expiration_s: float) -> bool:
        try:
            future = self.dht.store(
                key, value, expiration_s, subkey=self.subkey, return_future=True
            )
            stored = bool(future.result(timeout=STORE_TIMEOUT_S))
        except Exception as e:  # hivemind's failures vary (timeouts, a closing daemon): retried
            logger.warning("%s not stored: %r", key, e)
            return False
        if not stored:
            logger.warning("%s not stored: no replica accepted it", key)
        return stored

    def _rate(self, progress: LocalProgress) -> float:
        """Samples per second of training (round waits left out), smoothed like the native
        tracker's rate."""
        now_s, last = time.monotonic(), self._rate_from
        self._rate_from = (now_s, progress.total_samples, progress.round_s)
        if last is not None:
            elapsed_s = now_s - last[0]
            training_s = elapsed_s - (progress.round_s - last[2])
            num_new = progress.total_samples - last[1]
            if num_new >= 0 and training_s > 0.1 * elapsed_s > 0:
                weight = min(1.0, elapsed_s / RATE_SMOOTHING_S)
                self._samples_per_s += weight * (num_new / training_s - self._samples_per_s)
        return self._samples_per_s

    def publish_progress(self) -> bool:
        """Store a fresh progress record now; False (and a warning) if it was not stored."""
        progress, time_s = self.progress(), dht_time()
        value = {
            "peer_id": self.libp2p_id,
            "epoch": progress.epoch,
            "samples": progress.samples,
            "samples_per_s": self._rate(progress),
            "time": time_s,
            "address": self.address,
            "client_mode": self.client_mode,
        }
        return self._store(vp_progress_key(self.run_id), value, time_s + self.progress_ttl_s)

    def publish_profile(self) -> bool:
        """Store a fresh profile record now; False (and a warning) if it was not stored."""
        record = self.make_profile(dht_time())
        return self._store(
            profile_key(self.run_id), record.to_wire(), record.time + self.profile_ttl_s
        )

    def publish_rounds(self, *, force: bool = False) -> bool:
        """Store the round record if it changed or is due; True when a store happened and took."""
        version, epoch, now_s = self._version, self.progress().epoch, time.monotonic()
        if not force and self._published is not None:
            last_version, last_epoch, last_s = self._published
            fresh = now_s - last_s < self.rounds_ttl_s / 3
            if (version, epoch) == (last_version, last_epoch) and fresh:
                return False
        record = self.rounds_record()
        stored = self._store(
            rounds_key(self.run_id), record.to_wire(), record.time + self.rounds_ttl_s
        )
        if stored:
            self._published = (version, epoch, now_s)
        return stored

    def _run(self) -> None:
        next_profile_s = time.monotonic()
        try:
            while True:
                self.publish_progress()
                if not self._profiles_stopped.is_set() and time.monotonic() >= next_profile_s:
                    next_profile_s = time.monotonic() + self.profile_interval_s
                    self.publish_profile()
                self.publish_rounds()
                if self._stop.wait(self.interval_s):
                    return
        except Exception:  # a bug here must not go unseen, nor stop the training
            logger.exception("the hivemind record publisher failed; no more records")

    def start(self) -> None:
        """Publish now and then periodically, until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vp-hm-records", daemon=True)
            self._thread.start()

    def stop_profiles(self) -> None:
        """Publish no more profile records: the peer's training ended (the rolling window
        would reach into the time after it; see ``Profiler.stop_publishing``)."""
        self._profiles_stopped.set()

    def close(self) -> None:
        """Stop publishing (waits for a store in flight, at most its timeout); safe twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(2 * STORE_TIMEOUT_S + 1.0)
