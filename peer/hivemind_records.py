"""A hivemind swarm's records for the dashboard: what hivemind peers publish besides hivemind's own
progress, and how a reader collects them from hivemind's DHT.

Three hivemind.DHT dictionaries per run, one subkey per peer:

* ``{run}_progress``: hivemind.Optimizer's own progress records (its ``LocalTrainingProgress``:
  peer id bytes, epoch, samples accumulated, samples/s, time, client mode);
* ``{run}_vp_profile``: our :class:`peer.profile_record.ProfileRecord` (its wire form, plus the
  peer's first multiaddr as ``address``);
* ``{run}_vp_rounds``: our :class:`peer.round_log.RoundLogRecord` (its wire form).

A peer writes all three under the owner marker of its process-wide RSA key, the one hivemind's
ProgressTracker signs the progress record with: hivemind's ``RSASignatureValidator`` signs them,
and replicas and readers check the signature, so nobody else can change a peer's records. The
reader joins the three by that subkey and names each peer by the libp2p id in its progress
record (:func:`peer.hivemind_hook.swarm_peer_id`); profile and round records of a subkey without
a progress record are not shown, and no record can speak for another peer's subkey.

The reader (:class:`HivemindSwarmRecords`) is blocking and returns the lists that
:meth:`monitor.state.ViewBuilder.build` takes, so the monitor reads a hivemind swarm through the
same views as a native one without importing hivemind. hivemind is imported lazily.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dht.errors import ConfigError, DHTError
from dht.validation import OWNER_PREFIX
from peer.hivemind_hook import READ_TIMEOUT_S, dht_time, import_hivemind, swarm_peer_id
from peer.profile_record import ProfileRecord, parse_profile
from peer.progress import PeerProgress, parse_record
from peer.round_log import RoundEntry, RoundLogRecord, parse_rounds

logger = logging.getLogger(__name__)
# Bound on one store of a record, in seconds (the next period stores again).
STORE_TIMEOUT_S = READ_TIMEOUT_S
# Bound on starting a client-mode hivemind.DHT and joining through the initial peers, in seconds.
CLIENT_START_TIMEOUT_S = 60.0
# A profile record outlives this many profile periods (at least MIN_PROFILE_TTL_S seconds).
PROFILE_TTL_PERIODS = 4
MIN_PROFILE_TTL_S = 20.0
# A round record expires this long after it was stored (at least), in seconds; an unchanged one
# is stored again after a third of it.
MIN_ROUNDS_TTL_S = 60.0
# The largest believable rate of one peer (as the native monitor has it).
MAX_SAMPLES_PER_S = 1e6


def progress_key(run_id: str) -> str:
    """hivemind.Optimizer's progress key of ``run_id``."""
    return f"{run_id}_progress"


def profile_key(run_id: str) -> str:
    """The key of the profile records of a hivemind run."""
    return f"{run_id}_vp_profile"


def rounds_key(run_id: str) -> str:
    """The key of the round records of a hivemind run."""
    return f"{run_id}_vp_rounds"


def add_reader_validators(dht: Any, run_id: str) -> None:
    """Let ``dht`` check (and strip) the signatures of ``run_id``'s records and decode
    hivemind's progress records; a node without them cannot even decode the signed values."""
    from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
    from hivemind.optim.progress_tracker import TrainingProgressSchema

    dht.add_validators(
        [RSASignatureValidator(), SchemaValidator(TrainingProgressSchema, prefix=run_id)]
    )


# ---- publishing --------------------------------------------------------------------------------


class HivemindRecordPublisher:
    """Publishes one peer's profile and round records from a thread of its own.

    Every ``rounds_interval_s`` the round record is stored if it changed (or a third of its TTL
    passed); every ``profile_interval_s`` a fresh profile record. A failed store is logged and
    retried at the next period: publishing never stops the peer. :meth:`close` (safe twice)
    stops the thread; call it before the DHT shuts down.

    Args:
        dht: the peer's hivemind.DHT.
        run_id: the run (the keys' prefix).
        peer_id: the peer's :func:`peer.hivemind_hook.swarm_peer_id` (readers take it from the
            progress record instead: it is not published).
        make_profile: the profile record for a DHT time (unix seconds).
        epoch: the peer's epoch now.
        target_batch_size: samples per swarm epoch (published, so that readers know it).
        address: the peer's multiaddr (None in client mode).
        profile_interval_s: seconds between two profile records.
        rounds_interval_s: seconds between two looks at the round record.
        max_rounds: rounds kept and published.
    """

    def __init__(
        self,
        dht: Any,
        *,
        run_id: str,
        peer_id: str,
        make_profile: Callable[[float], ProfileRecord],
        epoch: Callable[[], int],
        target_batch_size: int,
        address: str | None,
        profile_interval_s: float,
        rounds_interval_s: float,
        max_rounds: int = 10,
    ):
        from hivemind.dht.schema import RSASignatureValidator

        validator = RSASignatureValidator()  # the process-wide key, as hivemind's tracker's
        dht.add_validators([validator])  # merged with the tracker's one if it is there
        self.dht = dht
        self.run_id = run_id
        self.peer_id = peer_id
        self.subkey = validator.local_public_key
        self.make_profile = make_profile
        self.epoch = epoch
        self.target_batch_size = target_batch_size
        self.address = address
        self.profile_interval_s = profile_interval_s
        self.rounds_interval_s = rounds_interval_s
        self.profile_ttl_s = max(PROFILE_TTL_PERIODS * profile_interval_s, MIN_PROFILE_TTL_S)
        self.rounds_ttl_s = max(10 * rounds_interval_s, MIN_ROUNDS_TTL_S)
        self.num_published = 0
        self._lock = threading.Lock()
        self._rounds: collections.deque[RoundEntry] = collections.deque(maxlen=max_rounds)
        self._counts = (0, 0, 0)  # rounds, failed, local steps
        self._version = 0
        self._published: tuple[int, int, float] | None = None  # version, epoch, monotonic s
        self._stop = threading.Event()
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
                epoch=self.epoch(),
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

    def publish_profile(self) -> bool:
        """Store a fresh profile record now; False (and a warning) if it was not stored."""
        record = self.make_profile(dht_time())
        value = {**record.to_wire(), "address": self.address}
        stored = self._store(profile_key(self.run_id), value, record.time + self.profile_ttl_s)
        self.num_published += stored
        return stored

    def publish_rounds(self, *, force: bool = False) -> bool:
        """Store the round record if it changed or is due; True when a store happened and took."""
        version, epoch, now_s = self._version, self.epoch(), time.monotonic()
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
                if time.monotonic() >= next_profile_s:
                    next_profile_s = time.monotonic() + self.profile_interval_s
                    self.publish_profile()
                self.publish_rounds()
                if self._stop.wait(min(self.rounds_interval_s, self.profile_interval_s)):
                    return
        except Exception:  # a bug here must not go unseen, nor stop the training
            logger.exception("the hivemind record publisher failed; no more records")

    def start(self) -> None:
        """Publish now and then periodically, until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vp-hm-records", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop publishing (waits for a store in flight, at most its timeout); safe twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(2 * STORE_TIMEOUT_S + 1.0)


# ---- reading -----------------------------------------------------------------------------------


def _items(found: Any) -> list[tuple[Any, Any]]:
    if found is None or not isinstance(found.value, dict):
        return []
    return [(subkey, getattr(item, "value", None)) for subkey, item in found.value.items()]


def _progress(value: Any, address: Any) -> PeerProgress | None:
    """hivemind's progress record as our :class:`PeerProgress`, or None (a peer that left stores
    None; a malformed record is skipped)."""
    if not isinstance(value, dict) or not isinstance(value.get("peer_id"), bytes):
        return None
    peer_id = swarm_peer_id(value["peer_id"])
    wire = {
        "epoch": value.get("epoch"),
        "samples": value.get("samples_accumulated"),
        "samples_per_s": value.get("samples_per_second"),
        "time": value.get("time"),
        "address": address if isinstance(address, str) else None,
        "client_mode": value.get("client_mode", False),
    }
    return parse_record(OWNER_PREFIX + peer_id, wire, MAX_SAMPLES_PER_S)


def parse_swarm(progress: Any, profiles: Any, rounds: Any) -> dict[str, list]:
    """The three lists :meth:`monitor.state.ViewBuilder.build` takes, from the results of
    ``dht.get`` on the three keys (None where a key is empty)."""
    address_of = {k: v.get("address") for k, v in _items(profiles) if isinstance(v, dict)}
    newest: dict[str, tuple[Any, PeerProgress]] = {}
    for subkey, value in _items(progress):
        record = _progress(value, address_of.get(subkey))
        if record is None or not math.isfinite(record.time):
            continue
        # two owners claiming one peer id: the newer record stands
        if record.peer_id not in newest or newest[record.peer_id][1].time < record.time:
            newest[record.peer_id] = (subkey, record)
    peer_of = {subkey: record.peer_id for subkey, record in newest.values()}
    parsed_profiles = [
        parse_profile(OWNER_PREFIX + peer_of[subkey], value)
        for subkey, value in _items(profiles)
        if subkey in peer_of
    ]
    parsed_rounds = [
        parse_rounds(OWNER_PREFIX + peer_of[subkey], value)
        for subkey, value in _items(rounds)
        if subkey in peer_of
    ]
    profiles_of = {p.peer_id: p for p in parsed_profiles if p is not None}
    return {
        "progress": [_measured_rate(record, profiles_of) for _, record in newest.values()],
        "profiles": list(profiles_of.values()),
        "rounds": [record for record in parsed_rounds if record is not None],
    }


def _measured_rate(record: PeerProgress, profiles_of: dict[str, ProfileRecord]) -> PeerProgress:
    """The peer's rate as its profile record measured it (samples its trainer took over the
    profiler's window), where there is one: hivemind's own estimate times only the intervals
    between its progress reports, and runs far ahead of the real rate (tens of times, with short
    steps), which would show the swarm's progress ahead of itself."""
    profile = profiles_of.get(record.peer_id)
    if profile is None:
        return record
    return dataclasses.replace(record, samples_per_s=min(profile.samples_per_s, MAX_SAMPLES_PER_S))


class HivemindSwarmRecords:
    """Reads a hivemind run's records through ``dht`` (blocking calls, any thread).

    The monitor's ``RecordSource``: :meth:`fetch` returns what
    :meth:`monitor.state.ViewBuilder.build` takes, :meth:`now` is hivemind's DHT time.

    Args:
        dht: a hivemind.DHT (a peer's own, a bootstrap node, or a client of the swarm).
        run_id: the run to read.
        source: where the records come from, for the dashboard's footer.
    """

    def __init__(self, dht: Any, run_id: str, *, source: str):
        add_reader_validators(dht, run_id)
        self.dht = dht
        self.run_id = run_id
        self.source = source

    def now(self) -> float:
        return dht_time()

    def fetch(self, timeout_s: float) -> dict[str, list]:
        """One read of the three keys (``latest=True``, at once) within ``timeout_s``.

        Raises:
            TimeoutError: not every key answered in time.
            DHTError: hivemind failed the read (e.g. its DHT process is gone).
        """
        keys = (progress_key(self.run_id), profile_key(self.run_id), rounds_key(self.run_id))
        deadline_s = time.monotonic() + timeout_s
        futures = []
        try:
            futures = [self.dht.get(key, latest=True, return_future=True) for key in keys]
            found = [f.result(timeout=max(0.0, deadline_s - time.monotonic())) for f in futures]
        except TimeoutError:
            for future in futures:
                future.cancel()
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None
        except Exception as e:  # translated at this boundary, as dht translates aiohttp's
            raise DHTError(f"hivemind DHT read failed: {e!r}") from e
        return parse_swarm(*found)


@contextmanager
def open_swarm_records(initial_peers: list[str], run_id: str) -> Iterator[HivemindSwarmRecords]:
    """A client-mode hivemind.DHT (its own process and p2pd; nothing to open in a firewall) that
    joined through ``initial_peers`` (libp2p multiaddrs), as a reader of ``run_id``.

    Raises:
        ConfigError: an address is not a multiaddr.
        DHTError: the DHT did not start or could not join within its timeout.
    """
    for address in initial_peers:
        if not address.startswith("/"):
            raise ConfigError(f"--initial-peers: {address!r} is not a libp2p multiaddr (/ip4/...)")
    hivemind = import_hivemind()
    logging.getLogger("hivemind").setLevel(
        max(logging.getLogger().getEffectiveLevel(), logging.WARNING)
    )
    dht = hivemind.DHT(initial_peers=list(initial_peers), client_mode=True, start=False)
    try:
        dht.run_in_background(await_ready=True, timeout=CLIENT_START_TIMEOUT_S)
    except Exception as e:  # hivemind raises whatever the daemon or the bootstrap raised
        dht.shutdown()
        raise DHTError(f"could not join the hivemind swarm via {initial_peers[0]}: {e}") from e
    try:
        yield HivemindSwarmRecords(dht, run_id, source=f"via {initial_peers[0]}")
    finally:
        dht.shutdown()
