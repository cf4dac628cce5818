"""An honest DHT node in its own process, driven by the adversarial tests.

Protocol (one JSON object a line): the test writes the spec (``initial_peers``, ``transport``
and ``dht`` config overrides; ``relay_urls``: be reached through one of these relays); the worker
answers ``{"peer_id", "address"}`` once it serves, then answers each command: ``info`` (memory,
routing table, storage, server counters), ``store`` (``key``, ``value``, ``ttl_s``, ``signed``),
``get`` (``key``, ``latest``), ``ping`` (``address``), ``pings`` (``address``, ``count``: each
latency), ``lookup`` (``key``: the lookup's outcome). With ``serve_streams`` the node also serves
two test streams: ``test.blob`` (a reply of n MiB) and ``test.sink`` (reads all).
Exceptions that escape a task reach the loop's exception handler, which writes ``UNHANDLED``
to the log (the tests look for it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

import psutil

from dht.config import DHTConfig, get_dht_time
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.kademlia.routing import DHTID
from dht.kademlia.validation import owner_subkey
from dht.net.config import TransportConfig


def _info(node: DHTNode, transport: HttpTransport) -> dict[str, Any]:
    server = transport.server
    return {
        "rss_bytes": psutil.Process().memory_info().rss,
        "routing": {p.peer_id: p.address for p in node.routing.peers()},
        "storage_records": len(node.storage),
        "storage_bytes": node.storage.num_bytes,
        "connections_open": transport.gate.num_open,
        "connections_refused": transport.gate.num_refused,
        "refused": server.num_refused,
        "nonces": len(server.replay),
        "bytes_in_flight": server.budget.in_use,
    }


async def _command(node: DHTNode, transport: HttpTransport, cmd: dict[str, Any]) -> Any:
    kind = cmd["cmd"]
    if kind == "info":
        return _info(node, transport)
    if kind == "store":
        subkey = owner_subkey(node.peer_id) if cmd.get("signed") else cmd.get("subkey")
        expiration = get_dht_time() + cmd.get("ttl_s", 60.0)
        outcome = await node.store_outcome(cmd["key"], cmd["value"], expiration, subkey)
        return {"ok": outcome.ok, "num_accepted": outcome.num_accepted, "reason": outcome.reason}
    if kind == "get":
        found = await node.get(cmd["key"], latest=cmd.get("latest", False))
        if found is None:
            return {"value": None}
        value = found.value
        if isinstance(value, dict):  # a dictionary key: {subkey: ValueWithExpiration}
            value = {str(k): v.value for k, v in value.items()}
        return {"value": value}
    if kind == "ping":
        peer = await node.protocol.ping(cmd["address"])
        return {"peer_id": peer.peer_id if peer else None}
    if kind == "pings":  # honest RPC latency, measured in this process
        return await _pings(node, cmd["address"], cmd.get("count", 20))
    if kind == "lookup":
        start = time.monotonic()
        found = await node.lookup(DHTID.from_key(cmd["key"]), want_value=True)
        return {
            "elapsed_s": time.monotonic() - start,
            "num_queried": found.num_queried,
            "num_failed": found.num_failed,
            "timed_out": found.timed_out,
        }
    raise ValueError(f"unknown command {kind!r}")


async def _pings(node: DHTNode, address: str, count: int) -> dict[str, Any]:
    """``count`` pings to ``address`` one after another: each latency in seconds (None for a
    ping that failed)."""
    latencies = []
    for _ in range(count):
        start = time.monotonic()
        peer = await node.protocol.ping(address)
        latencies.append(time.monotonic() - start if peer is not None else None)
    return {"latencies_s": latencies}


BLOB_CHUNK_BYTES = 1 << 20


async def _serve_blob(stream) -> None:
    """``test.blob``: reply with ``{"mib": n}`` and n MiB (a state download's shape)."""
    num_mib = min(int(stream.header.get("mib", 1)), 256)
    await stream.reply({"mib": num_mib})
    chunk = bytes(BLOB_CHUNK_BYTES)
    for _ in range(num_mib):
        await stream.send(chunk)


async def _serve_sink(stream) -> None:
    """``test.sink``: read every chunk the caller sends, then answer how many bytes."""
    num_bytes = 0
    while (chunk := await stream.recv()) is not None:
        num_bytes += len(chunk)
    await stream.reply({"bytes": num_bytes})


def _on_unhandled(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    sys.stderr.write(f"UNHANDLED {context.get('message')}: {context.get('exception')!r}\n")
    loop.default_exception_handler(context)


async def main() -> None:
    asyncio.get_running_loop().set_exception_handler(_on_unhandled)
    spec = json.loads(await asyncio.to_thread(sys.stdin.readline))
    identity = PeerIdentity.generate()
    transport_fields = dict(spec.get("transport", {}))
    if "swarm_key" in transport_fields:  # JSON has no bytes
        transport_fields["swarm_key"] = transport_fields["swarm_key"].encode()
    transport = HttpTransport(identity, TransportConfig(**transport_fields))
    config = DHTConfig(initial_peers=spec.get("initial_peers", []), **spec.get("dht", {}))
    node = DHTNode(transport=transport, identity=identity, config=config)
    if spec.get("serve_streams"):
        transport.add_stream_handler("test.blob", _serve_blob)
        transport.add_stream_handler("test.sink", _serve_sink)
    async with transport:
        if spec.get("relay_urls"):  # reached only through a relay (its relayed address)
            await transport.attach_relay(spec["relay_urls"])
        async with node:
            await _serve_commands(node, transport)


async def _serve_commands(node: DHTNode, transport: HttpTransport) -> None:
    print(json.dumps({"peer_id": node.peer_id, "address": node.address}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            answer = await _command(node, transport, json.loads(line))
        except Exception as e:  # the test sees it in the answer and fails there
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main())
