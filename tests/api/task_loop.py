"""A library peer training ``peer join``'s own task (run as a process by
tests/api/test_one_path.py): the synthetic task's model and data, wrapped by ``peer.Optimizer``
with ``model=`` so that its state has the keys a ``peer join`` peer's has.

``python -m tests.api.task_loop --seed S --epochs N --out FILE`` prints the DHT's URL as its
first line, trains until ``local_epoch == N`` and saves its parameters and rounds to ``FILE``
(plain tensors and lists: read with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import argparse
import sys

import torch

import peer
from peer.train.tasks import DataShard, load_task

TASK_OPTIONS = {"hidden_dim": "64", "num_eval_batches": "0"}
RUN_ID = "one-path"
TARGET_BATCH_SIZE = 256
LR = 1e-3


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = load_task("synthetic", TASK_OPTIONS)
    model = task.build_model()  # seeded: the same parameters as every peer's
    dht = peer.DHT()
    print(dht.urls[0], flush=True)
    opt = peer.Optimizer(
        dht=dht,
        run_id=RUN_ID,
        target_batch_size=TARGET_BATCH_SIZE,
        batch_size_per_step=task.batch_size,
        optimizer=lambda params: torch.optim.Adam(params, lr=LR),
        params=model.parameters(),
        model=model,
        matchmaking_time=10.0,
        averaging_timeout=20.0,
        publish_interval=0.2,
        wait_for_peers=2,
        summary=False,
    )
    with dht, opt:
        batches = iter(task.make_loader(DataShard(seed=args.seed)))
        while opt.local_epoch < args.epochs:
            inputs, targets = next(batches)
            loss = task.loss_fn(model(inputs), targets)
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
    stats = opt.stats
    torch.save(
        {
            "params": [p.detach().clone() for p in model.parameters()],
            "group_sizes": [outcome.num_peers for outcome in stats.history],
            "num_failed_rounds": stats.num_failed_rounds,
            "epoch": opt.local_epoch,
        },
        args.out,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
