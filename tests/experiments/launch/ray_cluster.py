"""A Ray cluster of several nodes on this machine, for the ray launcher's test.

Run it inside a network namespace with only loopback up (Ray then advertises 127.0.0.1): it
starts a head node with ``--head-cpus`` CPUs and ``--workers`` nodes of one CPU each (each with
a custom resource ``node-<i>`` naming it), prints ``{"address": ..., "nodes": [...]}`` as one
JSON line, and stops the cluster when its stdin closes (or on SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from ray.cluster_utils import Cluster

OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum is 75 MiB; the sweep stores nothing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-cpus", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally below stops the cluster
    common = {"object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": args.head_cpus, "resources": {"node-0": 1}, **common},
    )
    try:
        for index in range(1, args.workers + 1):
            cluster.add_node(num_cpus=1, resources={f"node-{index}": 1}, **common)
        cluster.wait_for_nodes()
        nodes = [cluster.head_node, *cluster.worker_nodes]
        print(
            json.dumps({"address": cluster.address, "nodes": [n.node_id for n in nodes]}),
            flush=True,
        )
        sys.stdin.read()  # until the test closes our stdin
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
