"""Per-RPC cost of the transport: ``python -m dht.tools.bench_rpc [--calls N] [--first-contacts
M]``.

Two real HttpTransports on 127.0.0.1 in this process (so the figures include both ends' CPU):
``--calls`` sequential echo RPCs of a small msgpack payload (the size of a DHT find) between one
client and one server, after a warm-up, and ``--first-contacts`` fresh clients making their
first call each (a connection and, from protocol v2 on, a handshake). Prints one JSON object:
``rpc_us_p50``, ``rpc_us_p90``, ``rpc_us_mean`` (wall time per call), ``rpc_cpu_us`` (CPU time
of both ends per call), ``first_call_us_p50``, ``calls``, ``first_contacts``. It uses only
the Transport API, so the same script measures older versions of the code for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from dht.http import HttpTransport, TransportConfig
from dht.identity import PeerIdentity

PAYLOAD = {"addr": "http://127.0.0.1:1234", "key": os.urandom(20), "value": True}


async def _echo(ctx, payload):
    return {"peer_id": "x" * 64, "nodes": {os.urandom(32).hex(): "http://127.0.0.1:1" for _ in
                                           range(20)}, "entry": None}  # fmt: skip


def _quantile_us(samples_s: list[float], q: float) -> float:
    ordered = sorted(samples_s)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 1)


async def run(num_calls: int, num_first_contacts: int) -> dict:
    # one client calls as fast as it can: above a stranger's share of requests, which is the point
    unlimited = dict(max_requests_per_s_per_peer=1e9, request_burst_per_peer=10**9)
    server = HttpTransport(PeerIdentity.generate(), TransportConfig(**unlimited))
    server.add_rpc_handler("echo", _echo)
    async with server, HttpTransport(PeerIdentity.generate(), TransportConfig()) as client:
        for _ in range(50):  # warm-up: connection, session, caches
            await client.call(server.address, "echo", PAYLOAD)
        calls_s = []
        cpu_start_s = time.process_time()
        for _ in range(num_calls):
            start = time.perf_counter()
            await client.call(server.address, "echo", PAYLOAD)
            calls_s.append(time.perf_counter() - start)
        cpu_s = time.process_time() - cpu_start_s
        first_s = []
        for _ in range(num_first_contacts):
            fresh = HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))
            async with fresh:
                start = time.perf_counter()
                await fresh.call(server.address, "echo", PAYLOAD)
                first_s.append(time.perf_counter() - start)
    return {
        "rpc_us_p50": _quantile_us(calls_s, 0.5),
        "rpc_us_p90": _quantile_us(calls_s, 0.9),
        "rpc_us_mean": round(statistics.fmean(calls_s) * 1e6, 1),
        # CPU of both ends per call: what the protocol costs, less exposed to a busy machine
        "rpc_cpu_us": round(cpu_s / num_calls * 1e6, 1),
        "first_call_us_p50": _quantile_us(first_s, 0.5),
        "calls": num_calls,
        "first_contacts": num_first_contacts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls (default 2000)")
    parser.add_argument(
        "--first-contacts", type=int, default=100, help="fresh clients (default 100)"
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.calls, args.first_contacts))))


if __name__ == "__main__":
    main()
