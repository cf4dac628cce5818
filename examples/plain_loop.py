"""A plain PyTorch training loop that trains together with other peers.

Start a first peer, then others with the URL it prints::

    python examples/plain_loop.py --epochs 20
    python examples/plain_loop.py --epochs 20 --initial-peers http://127.0.0.1:PORT

Each peer generates its own data (a noisy linear teacher: nothing is downloaded), wraps its
DataLoader in ``peer.profile`` (so waiting for batches counts as ``data``), and calls
``opt.step()`` after each backward pass; every ``--target-batch-size`` samples gathered by the
swarm, the peers average their gradients and step together. At exit it prints the profiler's
table, and as its last line a JSON object with the first and last epochs' mean loss.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import peer


def make_data(seed: int, num_samples: int = 4096) -> TensorDataset:
    teacher = torch.Generator().manual_seed(0)  # every peer learns the same function
    weight = torch.randn(32, 8, generator=teacher)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, 32, generator=generator)
    targets = torch.tanh(inputs @ weight) + 0.05 * torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(inputs, targets)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[], help="URLs of swarm peers")
    parser.add_argument("--run-id", default="plain-loop", help="the run's name")
    parser.add_argument("--epochs", type=int, default=20, help="swarm epochs to train")
    parser.add_argument("--target-batch-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=None, help="data seed (default: random)")
    parser.add_argument("--wait-for-peers", type=int, default=1, help="start with this many")
    parser.add_argument("--metrics-file", default=None, help="JSON Lines metrics stream")
    parser.add_argument("--trace", default=None, help="Perfetto trace of the phases")
    parser.add_argument("--save", default=None, help="save the final parameters here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial model everywhere (a newcomer downloads it anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    seed = args.seed if args.seed is not None else int(torch.randint(1 << 30, ()))
    loader = DataLoader(make_data(seed), batch_size=args.batch_size, shuffle=True)

    with peer.DHT(initial_peers=args.initial_peers) as dht:
        print(f"initial peers: {dht.urls[0] if dht.urls else args.initial_peers[0]}", flush=True)
        print(f"peer {dht.peer_id} joined run {args.run_id}", flush=True)
        opt = peer.Optimizer(
            dht=dht,
            run_id=args.run_id,
            target_batch_size=args.target_batch_size,
            batch_size_per_step=args.batch_size,
            optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
            params=model.parameters(),
            matchmaking_time=3.0,
            averaging_timeout=10.0,
            wait_for_peers=args.wait_for_peers,
            metrics_file=args.metrics_file,
            trace=args.trace,
            verbose=True,
        )
        losses: dict[int, list[float]] = {}
        with opt:
            while opt.local_epoch < args.epochs:
                for inputs, targets in peer.profile(loader):
                    loss = torch.nn.functional.mse_loss(model(inputs), targets)
                    loss.backward()
                    losses.setdefault(opt.local_epoch, []).append(loss.item())
                    opt.step(loss=loss)
                    opt.zero_grad()
                    if opt.local_epoch >= args.epochs:
                        break
        epochs = sorted(losses)
        result = {
            "epoch": opt.local_epoch,
            "first_loss": sum(losses[epochs[0]]) / len(losses[epochs[0]]),
            "last_loss": sum(losses[epochs[-1]]) / len(losses[epochs[-1]]),
            "rounds_with_others": sum(o.num_peers >= 2 for o in opt.stats.history),
        }
    if args.save:
        torch.save([p.detach() for p in model.parameters()], args.save)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
