"""``peer dht``, ``peer bench dht`` and ``peer demo`` (until the training demo arrives)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from dht.errors import ConfigError
from dht.identity import PeerIdentity, short_id
from dht.net.config import TransportConfig
from dht.options import NETWORK_OPTIONS, add_network_args, peer_url, positive_int, read_swarm_key


def transport_config(args: argparse.Namespace, *, client_mode: bool = False) -> TransportConfig:
    return TransportConfig(
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        source_host=args.source_host,
        client_mode=client_mode,
        swarm_key=read_swarm_key(args.swarm_key_file),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        tls_ca_file=args.tls_ca,
        relay_enabled=not getattr(args, "no_relay", False),
        max_relayed_bytes_per_s=getattr(
            args, "max_relayed_bytes_per_s", NETWORK_OPTIONS["max_relayed_bytes_per_s"].default
        ),
    )


def identity(args: argparse.Namespace) -> PeerIdentity:
    return PeerIdentity.load_or_create(args.identity) if args.identity else PeerIdentity.generate()


def _check_urls(urls: list[str]) -> list[str]:
    try:
        return [peer_url(url) for url in urls]
    except ValueError as e:
        raise ConfigError(f"--initial-peers: {e}") from None


# ---- peer dht ---------------------------------------------------------------------------------


def add_dht_command(sub) -> None:
    parser = sub.add_parser(
        "dht",
        help="run a DHT / bootstrap node (prints its URL first)",
        description="Run a standalone DHT node that others bootstrap from. "
        "The first line of output is its URL.",
    )
    add_network_args(parser)
    parser.set_defaults(run=run_dht)


def run_dht(args: argparse.Namespace) -> int:
    from dht.config import DHTConfig
    from dht.gc_policy import settle as settle_gc
    from dht.launch import open_node

    dht_config = DHTConfig(initial_peers=_check_urls(args.initial_peers))
    config, me = transport_config(args), identity(args)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with open_node(me, config, dht_config) as node:
            settle_gc()  # started: the collector's policy for a long run
            print(node.address, flush=True)
            sys.stderr.write(
                f"DHT node {short_id(me.peer_id)} serving on {node.address}; Ctrl-C stops it\n"
            )
            await stop.wait()
        sys.stderr.write("DHT node stopped\n")

    asyncio.run(serve())
    return 0


# ---- peer bench dht ---------------------------------------------------------------------------


def add_bench_dht_command(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "dht",
        help="N real DHT nodes on loopback: store/get latency, bootstrap time, memory",
        description="Start N DHT nodes (each its own server) on 127.0.0.1 in this process, store "
        "from random nodes, get from other random nodes; the last line of stdout is "
        "one JSON object.",
    )
    parser.add_argument(
        "--nodes", type=positive_int, default=32, help="number of nodes (default: 32)"
    )
    parser.add_argument(
        "--keys",
        type=positive_int,
        default=200,
        help="values stored, each read back once (default: 200)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--backend",
        choices=["native", "hivemind"],
        default="native",
        help="native, or hivemind.DHT nodes, each its own process + p2pd (default: native)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(run=run_bench_dht)


def run_bench_dht(args: argparse.Namespace) -> int:
    if args.backend == "hivemind":
        from peer.hivemind.bench import run_hivemind_dht_bench

        result = run_hivemind_dht_bench(num_nodes=args.nodes, num_keys=args.keys, seed=args.seed)
    else:
        from dht.tools.bench import run_dht_bench

        result = asyncio.run(
            run_dht_bench(num_nodes=args.nodes, num_keys=args.keys, seed=args.seed)
        )
    if not args.json:
        for name, value in result.items():
            print(f"{name:>16}: {value}")
    print(json.dumps(result))
    return 0


# ---- peer demo -------------------------------------------------------------------------------


def add_demo_command(sub) -> None:
    parser = sub.add_parser(
        "demo",
        help="a local swarm training on loopback, watched live",
        description="Start a bootstrap node and N `peer join` processes on 127.0.0.1, show the "
        "swarm live, and print a summary (with --json, one contract JSON line).",
    )
    parser.add_argument("--peers", type=positive_int, default=3, help="peers (default: 3)")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long the peers train (default: 60)"
    )
    parser.add_argument(
        "--target-batch-size",
        type=positive_int,
        default=2048,
        help="samples per swarm epoch (default: 2048)",
    )
    parser.add_argument(
        "--backend",
        choices=["native", "hivemind"],
        default="native",
        help="networking backend of the peers (default: native)",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.set_defaults(run=run_demo)


def demo_dashboard(target_batch_size: int, backend: str = "native"):
    """The monitor's dashboard for ``peer demo`` (see :data:`peer.cli.demo.DashboardFactory`)."""
    from monitor.config import MonitorConfig
    from monitor.embed import swarm_dashboard
    from peer.cli.demo import REFRESH_S, RUN_ID

    config = MonitorConfig(run_id=RUN_ID, interval_s=REFRESH_S, target_batch_size=target_batch_size)
    if backend == "hivemind":
        from peer.cli.hivemind import demo_dashboard as hivemind_dashboard

        return hivemind_dashboard(config)

    def factory(node, loop, console, on_quit):
        return swarm_dashboard(loop, node, config=config, on_quit=on_quit, console=console)

    return factory


def run_demo(args: argparse.Namespace) -> int:
    from peer.cli.demo import run_demo as demo

    return asyncio.run(
        demo(
            num_peers=args.peers,
            seconds=args.seconds,
            target_batch_size=args.target_batch_size,
            as_json=args.json,
            backend=args.backend,
            dashboard=demo_dashboard(args.target_batch_size, args.backend),
        )
    )
