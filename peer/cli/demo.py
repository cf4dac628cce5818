"""``peer demo``: a bootstrap node and N training peers on loopback, watched live.

The peers are real ``peer join`` processes (torch threads split so that together they use the
machine's cores once); this process runs the bootstrap DHT node (ours, or a hivemind.DHT with
``--backend hivemind``) and reads the peers' records through it: the monitor's dashboard when the
command line hands one in (``dashboard``), a small progress table otherwise. q on the dashboard
stops the peers early. At the end every peer's summary is collected.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, AsyncExitStack
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from dht.config import DHTConfig
from dht.errors import DHTError
from dht.identity import PeerIdentity, short_id
from dht.kademlia.node import DHTNode
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.records.progress import PeerProgress
from peer.records.progress_read import ProgressSweep
from peer.run.flags import join_command

RUN_ID = "demo"
REFRESH_S = 0.5
# Bound on one read of the hivemind bootstrap's records for the table, in seconds.
HIVEMIND_READ_TIMEOUT_S = 10.0
# (bootstrap, its event loop, console, on_quit) -> a context manager showing the swarm while it
# is open; the monitor provides it (this package may not import the monitor). The bootstrap is
# our DHTNode, served on that loop, or with the hivemind backend the HivemindBootstrap.
DashboardFactory = Callable[
    [Any, asyncio.AbstractEventLoop, Console, Callable[[], None]], AbstractContextManager
]


def _peer_command(
    url: str, seconds: float, threads: int, target: int, backend: str = "native", num_peers: int = 1
) -> list[str]:
    return [
        sys.executable,
        *join_command(
            backend=backend,
            run_id=RUN_ID,
            initial_peers=[url],
            max_time=seconds,
            torch_threads=threads,
            target_batch_size=target,
            # start together: a peer that starts alone runs ahead, stepping alone
            wait_for_peers=num_peers,
        ),
    ]


def _rows(records: list[PeerProgress]) -> list[tuple[str, ...]]:
    return [
        (
            short_id(r.peer_id),
            r.address or ("client" if r.client_mode else "-"),
            str(r.epoch),
            str(r.samples),
            f"{r.samples_per_s:.0f}",
        )
        for r in sorted(records, key=lambda r: r.peer_id)
    ]


async def _native_progress(node: DHTNode, sweep: ProgressSweep) -> list[PeerProgress]:
    return await sweep.read(node)


def _hivemind_progress(records) -> list[PeerProgress]:
    try:
        return records.fetch(HIVEMIND_READ_TIMEOUT_S)["progress"]
    except (TimeoutError, DHTError):  # an empty table this time; the next refresh reads again
        return []


def _swarm_table(rows: list[tuple[str, ...]], num_peers: int, elapsed_s: float) -> Table:
    table = Table(
        title=f"Volunteer Peer demo: {len(rows)}/{num_peers} peers training, {elapsed_s:4.0f} s"
    )
    for column in ("peer", "address", "epoch", "samples this epoch", "samples/s"):
        table.add_column(column, justify="right" if column != "address" else "left")
    for row in rows:
        table.add_row(*row)
    return table


async def run_demo(
    *,
    num_peers: int,
    seconds: float,
    target_batch_size: int,
    as_json: bool,
    backend: str = "native",
    dashboard: DashboardFactory | None = None,
) -> int:
    """Run the demo; returns the exit status (0 when every peer finished and trained)."""
    console = Console(stderr=as_json)
    threads = max(1, (os.cpu_count() or 1) // num_peers)
    async with AsyncExitStack() as stack:
        bootstrap, address, progress = await _open_bootstrap(stack, backend, table=not dashboard)

        processes = [
            await asyncio.create_subprocess_exec(
                *_peer_command(address, seconds, threads, target_batch_size, backend, num_peers),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            for _ in range(num_peers)
        ]
        outputs = [asyncio.create_task(process.communicate()) for process in processes]
        start = time.monotonic()
        try:
            if dashboard is not None:
                await _watch_dashboard(dashboard, bootstrap, console, processes, outputs)
            else:
                with Live(console=console, refresh_per_second=2) as live:
                    while not all(task.done() for task in outputs):
                        elapsed_s = time.monotonic() - start
                        rows = _rows(await progress())
                        live.update(_swarm_table(rows, num_peers, elapsed_s))
                        await asyncio.wait(outputs, timeout=REFRESH_S)
        finally:
            for process in processes:
                if process.returncode is None:
                    process.terminate()
            await asyncio.gather(*outputs, return_exceptions=True)
    summaries = []
    for process, task in zip(processes, outputs, strict=True):
        stdout, stderr = task.result()
        lines = stdout.decode().strip().splitlines()
        if process.returncode != 0 or not lines:
            console.print(
                f"[red]a peer failed (exit {process.returncode}):[/red] "
                f"{stderr.decode().strip().splitlines()[-1:]}"
            )
            continue
        summaries.append(json.loads(lines[-1]))
    console.print()
    seconds = max((s["seconds"] for s in summaries), default=time.monotonic() - start)
    return _report(console, summaries, num_peers, seconds, as_json)


async def _open_bootstrap(
    stack: AsyncExitStack, backend: str, *, table: bool
) -> tuple[Any, str, Callable[[], Awaitable[list[PeerProgress]]]]:
    """The bootstrap node (closed with ``stack``), its address, and a reader of the peers'
    progress records for the table (``table``: the table needs it)."""
    if backend == "hivemind":
        from peer.hivemind.backend import HivemindBootstrap

        bootstrap = stack.enter_context(HivemindBootstrap())
        records = None
        if table:
            from peer.hivemind.swarm import HivemindSwarmRecords

            records = HivemindSwarmRecords(bootstrap.dht, RUN_ID, source=bootstrap.address)

        async def hivemind_progress() -> list[PeerProgress]:
            return await asyncio.to_thread(_hivemind_progress, records)

        return bootstrap, bootstrap.address, hivemind_progress
    node = await stack.enter_async_context(
        open_node(PeerIdentity.generate(), TransportConfig(), DHTConfig())
    )

    sweep = ProgressSweep(RUN_ID, max_samples_per_s=1e9)

    async def native_progress() -> list[PeerProgress]:
        return await _native_progress(node, sweep)

    return node, node.address, native_progress


async def _watch_dashboard(
    dashboard: DashboardFactory,
    node: Any,
    console: Console,
    processes: list[asyncio.subprocess.Process],
    outputs: list[asyncio.Task],
) -> None:
    """Show the dashboard until every peer ended; q asks the peers to stop (they still report)."""
    loop = asyncio.get_running_loop()
    quit_requested = asyncio.Event()
    with dashboard(node, loop, console, lambda: loop.call_soon_threadsafe(quit_requested.set)):
        stopping = False
        while not all(task.done() for task in outputs):
            await asyncio.wait(outputs, timeout=REFRESH_S)
            if quit_requested.is_set() and not stopping:
                stopping = True
                for process in processes:
                    if process.returncode is None:
                        process.send_signal(signal.SIGTERM)  # `peer join` stops and reports


def _report(
    console: Console, summaries: list[dict], num_peers: int, seconds: float, as_json: bool
) -> int:
    losses = [s["final_loss"] for s in summaries if s["final_loss"] is not None]
    result = {
        "peers": num_peers,
        "seconds": round(seconds, 2),
        "rounds": max((s["epoch"] for s in summaries), default=0),
        "final_loss": round(sum(losses) / len(losses), 4) if losses else None,
        "samples_per_s": round(sum(s["num_samples"] for s in summaries) / seconds, 1),
    }
    console.print(
        f"{len(summaries)}/{num_peers} peers finished: {result['rounds']} rounds, "
        f"final loss {result['final_loss']}, {result['samples_per_s']} samples/s "
        "for the swarm"
    )
    if as_json:
        print(json.dumps(result), flush=True)
    return 0 if len(summaries) == num_peers and result["rounds"] > 0 else 1
