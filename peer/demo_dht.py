"""``peer demo`` until the training peer lands: a DHT swarm on loopback, watched live.

Each node publishes a signed heartbeat record under its own subkey of one key; node 0 reads the
merged dictionary back every half second and a rich table shows what the swarm sees.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

from rich.console import Console
from rich.live import Live
from rich.table import Table

from dht.config import DHTConfig, get_dht_time
from dht.http_config import TransportConfig
from dht.identity import PeerIdentity, short_id
from dht.launch import open_node
from dht.node import DHTNode
from dht.validation import owner_subkey, subkey_owner

KEY = "demo/heartbeats"
HEARTBEAT_INTERVAL_S = 0.5
EXPIRATION_S = 5.0


async def _heartbeat(node: DHTNode, stop: asyncio.Event) -> None:
    beat = 0
    while not stop.is_set():
        beat += 1
        await node.store(
            KEY,
            {"beat": beat, "address": node.address},
            get_dht_time() + EXPIRATION_S,
            subkey=owner_subkey(node.peer_id),
        )
        try:
            await asyncio.wait_for(stop.wait(), HEARTBEAT_INTERVAL_S)
        except TimeoutError:
            pass


def _table(found, num_peers: int, elapsed_s: float) -> Table:
    table = Table(
        title=f"DHT swarm on loopback: {len(found)}/{num_peers} peers seen, {elapsed_s:4.1f} s"
    )
    for column in ("peer", "address", "heartbeats", "expires in (s)"):
        table.add_column(column)
    now = get_dht_time()
    for subkey, record in sorted(found.items(), key=lambda item: item[0]):
        table.add_row(
            short_id(subkey_owner(subkey) or str(subkey)),
            record.value["address"],
            str(record.value["beat"]),
            f"{record.expiration_time - now:.1f}",
        )
    return table


async def run_dht_demo(*, num_peers: int, duration_s: float) -> int:
    """Run the demo; returns the exit status (0 when every node was seen by node 0)."""
    console = Console()
    async with AsyncExitStack() as stack:
        nodes: list[DHTNode] = []
        for _ in range(num_peers):
            initial = [nodes[0].address] if nodes else []
            nodes.append(
                await stack.enter_async_context(
                    open_node(
                        PeerIdentity.generate(), TransportConfig(), DHTConfig(initial_peers=initial)
                    )
                )
            )
        stop = asyncio.Event()
        beats = [asyncio.create_task(_heartbeat(node, stop)) for node in nodes]
        start, found = time.monotonic(), {}
        try:
            with Live(console=console, refresh_per_second=4) as live:
                while (elapsed_s := time.monotonic() - start) < duration_s:
                    result = await nodes[0].get(KEY, latest=True)
                    found = result.value if result else {}
                    live.update(_table(found, num_peers, elapsed_s))
                    await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*beats)
    console.print(
        f"{len(found)} of {num_peers} peers seen through the DHT. Training arrives "
        "with `peer join` (the training-peer issue); this demo shows the swarm layer."
    )
    return 0 if len(found) == num_peers else 1
