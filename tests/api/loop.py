"""A user's training loop on ``peer.Optimizer`` (run as a process by the tests), and the data
and model it trains, shared with the single-process reference.

``python -m tests.api.loop --seed S --epochs N --out FILE [--initial-peers URL]`` prints the
DHT's URL as its first line, trains until ``local_epoch == N`` and saves its parameters, the
samples it gave each epoch and its rounds to ``FILE`` (plain tensors and lists: read with
``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import argparse
import sys

import torch

import peer

BATCH = 16
IN_DIM, HIDDEN, OUT_DIM = 8, 16, 4
LR = 5e-2


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every peer starts from the same parameters
    return torch.nn.Sequential(
        torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT_DIM)
    )


def make_batch(seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of the peer with data seed ``seed``: a fixed linear teacher plus noise."""
    teacher = torch.Generator().manual_seed(1234)
    weight = torch.randn(IN_DIM, OUT_DIM, generator=teacher)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    inputs = torch.randn(BATCH, IN_DIM, generator=generator)
    noise = 0.1 * torch.randn(BATCH, OUT_DIM, generator=generator)
    return inputs, inputs @ weight + noise


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--target-batch-size", type=int, default=128)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--mode", default="grad", choices=["grad", "params", "diloco"])
    parser.add_argument("--delay", action="store_true", help="delay_optimizer_step=True")
    parser.add_argument("--client-mode", action="store_true", help="run no server (NAT)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dht = peer.DHT(initial_peers=args.initial_peers, client_mode=args.client_mode)
    print((dht.urls or args.initial_peers)[0], flush=True)
    model = build_model()
    opt = peer.Optimizer(
        dht=dht,
        run_id="api-test",
        target_batch_size=args.target_batch_size,
        batch_size_per_step=BATCH,
        optimizer=lambda params: torch.optim.Adam(params, lr=LR),
        params=model.parameters(),
        matchmaking_time=10.0,
        averaging_timeout=20.0,
        publish_interval=0.2,
        wait_for_peers=args.peers,
        mode=args.mode,
        delay_optimizer_step=args.delay,
        summary=False,
    )
    index, losses = 0, []
    with dht, opt:
        while opt.local_epoch < args.epochs:
            loss = loss_fn(model, make_batch(args.seed, index))
            losses.append(float(loss))
            index += 1
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
    # after shutdown: a delayed round still in flight has been applied
    stats = opt.stats
    result = {
        "params": [p.detach().clone() for p in model.parameters()],
        "epoch_samples": list(stats.epoch_samples),
        "group_sizes": [outcome.num_peers for outcome in stats.history],
        "num_failed_rounds": stats.num_failed_rounds,
        "epoch": opt.local_epoch,
        "losses": losses,
    }
    torch.save(result, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
