"""Reads a run's records from the DHT into :class:`monitor.state.SwarmView` frames.

Per run, the progress buckets (``{run}/progress/{level}/{bucket}``, :mod:`peer.records.progress`;
the dashboard is no peer and reads every bucket of the levels in use,
:class:`peer.records.progress_read.ProgressSweep`);
then, at the levels the peers counted reads as in use, the buckets of one signed record per peer
of ``{run}/profile`` (:mod:`peer.records.profile`), ``{run}/rounds`` (:mod:`peer.records.rounds`)
and ``{run}/state`` (:mod:`peer.records.state`: the digests that mark a replica differing from
its group's; all three :mod:`peer.records.buckets`). All under one timeout (``latest=True``
while few keys: the merge of the k closest replicas); a failed read keeps the last records and
says why. Every record passes the schema of
:mod:`peer.records` (the rest is dropped and counted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dht.config import DHTConfig, get_dht_time
from dht.errors import DHTError
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.launch import open_node
from dht.net.config import TransportConfig
from monitor.config import MonitorConfig
from monitor.state import SwarmView, ViewBuilder
from peer.records.buckets import read_every_record
from peer.records.profile import PROFILE_RECORDS_PER_BUCKET, parse_profile, profile_key
from peer.records.progress_read import ProgressSweep
from peer.records.rounds import ROUNDS_RECORDS_PER_BUCKET, parse_rounds, rounds_key
from peer.records.state import STATE_RECORDS_PER_BUCKET, parse_state, state_key

logger = logging.getLogger(__name__)
# The largest believable rate of one peer (as :class:`peer.swarm.progress.ProgressConfig` has it).
MAX_SAMPLES_PER_S = 1e6


class SwarmReader:
    """Reads the run's records through ``node`` and builds successive views.

    One read at a time (the views remember the previous one). ``local_peer_id`` marks the peer
    the dashboard runs in (``peer join --dashboard``).
    """

    def __init__(self, node: DHTNode, config: MonitorConfig, *, local_peer_id: str | None = None):
        self.node = node
        self.config = config
        self.builder = ViewBuilder(config, local_peer_id=local_peer_id)
        self.progress = ProgressSweep(config.run_id, max_samples_per_s=MAX_SAMPLES_PER_S)
        self._records: dict[str, list] = {
            "progress": [],
            "profiles": [],
            "rounds": [],
            "states": [],
        }

    async def _fetch(self) -> dict[str, list]:
        run_id = self.config.run_id
        progress = await self.progress.read(self.node)
        num_peers = max(len(progress), 1)
        profiles, rounds, states = await asyncio.gather(
            read_every_record(
                self.node,
                profile_key(run_id),
                num_peers=num_peers,
                records_per_bucket=PROFILE_RECORDS_PER_BUCKET,
                parse=parse_profile,
            ),
            read_every_record(
                self.node,
                rounds_key(run_id),
                num_peers=num_peers,
                records_per_bucket=ROUNDS_RECORDS_PER_BUCKET,
                parse=parse_rounds,
            ),
            read_every_record(
                self.node,
                state_key(run_id),
                num_peers=num_peers,
                records_per_bucket=STATE_RECORDS_PER_BUCKET,
                parse=parse_state,
                newest_by=lambda announcement: announcement.epoch,
            ),
        )
        parsed = {
            "progress": progress,
            "profiles": profiles,
            "rounds": rounds,
            "states": states,
        }
        return {name: [r for r in records if r is not None] for name, records in parsed.items()}

    async def read(self) -> SwarmView:
        """The swarm now; on a failed read, the last records with ``error`` set."""
        error = None
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                self._records = await self._fetch()
        except TimeoutError:
            error = f"no answer within {self.config.read_timeout_s:g} s"
        except DHTError as e:
            error = str(e) or type(e).__name__
        if error is not None:
            logger.debug("swarm read failed: %s", error)
        return self.builder.build(**self._records, now=get_dht_time(), error=error)


@asynccontextmanager
async def open_client_node(
    initial_peers: list[str],
    *,
    swarm_key: bytes | None = None,
    tls_ca_file: str | None = None,
) -> AsyncIterator[DHTNode]:
    """A DHT node in client mode (no server, nothing to open in a firewall) that has joined
    through ``initial_peers``."""
    transport_config = TransportConfig(
        client_mode=True, swarm_key=swarm_key, tls_ca_file=tls_ca_file
    )
    dht_config = DHTConfig(initial_peers=tuple(initial_peers))
    async with open_node(PeerIdentity.generate(), transport_config, dht_config) as node:
        yield node
