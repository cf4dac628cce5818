"""Reads a hivemind swarm's records (keys in :mod:`peer.hivemind.records`) into the lists that
:meth:`monitor.state.ViewBuilder.build` takes, so the monitor shows a hivemind swarm through the
same views as a native one without importing hivemind.

The records are joined by their subkey, the owner marker of the publisher's RSA key, which
hivemind's signature validator binds to the signer; each peer is named by the libp2p id in its
progress record (:func:`peer.hivemind.hook.swarm_peer_id`). Our progress record (fresh every
publishing interval) stands, with the epoch and samples of hivemind's own where hivemind stored
that one since (it does at each epoch change); a peer that publishes only hivemind's (a plain
hivemind.Optimizer script) is shown from it. Profile and round records whose subkey has no
progress record are not shown. hivemind is imported lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dht.errors import ConfigError, DHTError
from dht.kademlia.validation import OWNER_PREFIX
from peer.hivemind.hook import dht_time, import_hivemind, swarm_peer_id
from peer.hivemind.records import profile_key, progress_key, rounds_key, vp_progress_key
from peer.records.profile import parse_profile
from peer.records.progress import PeerProgress, parse_record
from peer.records.rounds import parse_rounds

logger = logging.getLogger(__name__)
# Bound on starting a client-mode hivemind.DHT and joining through the initial peers, in seconds.
CLIENT_START_TIMEOUT_S = 60.0
# The largest believable rate of one peer (as the native monitor has it).
MAX_SAMPLES_PER_S = 1e6


def add_reader_validators(dht: Any, run_id: str) -> None:
    """Let ``dht`` check (and strip) the signatures of ``run_id``'s records and decode
    hivemind's progress records; a node without them cannot even decode the signed values."""
    from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
    from hivemind.optim.progress_tracker import TrainingProgressSchema

    dht.add_validators(
        [RSASignatureValidator(), SchemaValidator(TrainingProgressSchema, prefix=run_id)]
    )


def _items(found: Any) -> list[tuple[Any, Any]]:
    if found is None or not isinstance(found.value, dict):
        return []
    return [(subkey, getattr(item, "value", None)) for subkey, item in found.value.items()]


def _progress(value: Any, *, hivemind_fields: bool) -> PeerProgress | None:
    """A progress record (ours, or hivemind's own) as a :class:`PeerProgress`, or None (a peer
    that left stores None; a malformed record is skipped)."""
    if not isinstance(value, dict) or not isinstance(value.get("peer_id"), bytes):
        return None
    if hivemind_fields:
        value = {
            "epoch": value.get("epoch"),
            "samples": value.get("samples_accumulated"),
            "samples_per_s": value.get("samples_per_second"),
            "time": value.get("time"),
            "client_mode": value.get("client_mode", False),
            "peer_id": value["peer_id"],
        }
    record = parse_record(
        OWNER_PREFIX + swarm_peer_id(value["peer_id"]), value, MAX_SAMPLES_PER_S, multiaddr=True
    )
    return record if record is not None and math.isfinite(record.time) else None


def parse_swarm(
    hivemind_progress: Any, vp_progress: Any, profiles: Any, rounds: Any
) -> dict[str, list]:
    """``progress``, ``profiles`` and ``rounds`` for :meth:`monitor.state.ViewBuilder.build`,
    from the results of ``dht.get`` on the four keys (None where a key is empty)."""
    hivemind_of = _progress_by_subkey(hivemind_progress, hivemind_fields=True)
    ours_of = _progress_by_subkey(vp_progress, hivemind_fields=False)
    by_peer: dict[str, tuple[Any, PeerProgress]] = {}
    for subkey in hivemind_of.keys() | ours_of.keys():
        ours, theirs = ours_of.get(subkey), hivemind_of.get(subkey)
        record = ours or theirs
        if ours and theirs and theirs.time > ours.time and theirs.peer_id == ours.peer_id:
            # hivemind stored its record at an epoch change since ours: its epoch and samples
            record = dataclasses.replace(
                ours, epoch=theirs.epoch, samples=theirs.samples, time=theirs.time
            )
        # two owners claiming one peer id: the newer record stands
        if record.peer_id not in by_peer or by_peer[record.peer_id][1].time < record.time:
            by_peer[record.peer_id] = (subkey, record)
    peer_of = {subkey: peer_id for peer_id, (subkey, _) in by_peer.items()}
    parsed_profiles = [
        parse_profile(OWNER_PREFIX + peer_of[subkey], value)
        for subkey, value in _items(profiles)
        if subkey in peer_of
    ]
    profile_of = {p.peer_id: p for p in parsed_profiles if p is not None}
    parsed_rounds = [
        parse_rounds(OWNER_PREFIX + peer_of[subkey], value)
        for subkey, value in _items(rounds)
        if subkey in peer_of
    ]
    return {
        "progress": [record for _, record in by_peer.values()],
        "profiles": list(profile_of.values()),
        "rounds": [record for record in parsed_rounds if record is not None],
    }


def _progress_by_subkey(found: Any, *, hivemind_fields: bool) -> dict[Any, PeerProgress]:
    records = {}
    for subkey, value in _items(found):
        record = _progress(value, hivemind_fields=hivemind_fields)
        if record is not None:
            records[subkey] = record
    return records


class HivemindSwarmRecords:
    """Reads a hivemind run's records through ``dht`` (blocking calls, any thread).

    A ``monitor.records.RecordSource``: :meth:`fetch` returns what
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
        """One read of the four keys (``latest=True``, at once) within ``timeout_s``.

        Raises:
            TimeoutError: not every key answered in time.
            DHTError: hivemind failed the read (e.g. its DHT process is gone).
        """
        key_of = (progress_key, vp_progress_key, profile_key, rounds_key)
        keys = [key(self.run_id) for key in key_of]
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
