"""PyTorch Lightning: train a LightningModule together with other peers through a callback.

``SwarmCallback`` wraps the module's own optimizer in a ``peer.Optimizer`` when fitting starts
and reports every step to it; the module's code does not change. Start a first peer, then others
with the URL it prints::

    python examples/lightning_callback.py --swarm-epochs 10
    python examples/lightning_callback.py --swarm-epochs 10 --initial-peers http://127.0.0.1:PORT

How it fits Lightning's loop: Lightning calls ``on_before_optimizer_step`` after the backward
pass and before the optimizer's update. There the callback hands the gradients to
``peer.Optimizer.step`` (which accumulates them, or steps and averages, as the mode says, and
leaves ``.grad`` empty), so Lightning's own update that follows finds no gradient and changes
nothing. Needs ``pip install lightning``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import peer


class SwarmCallback(L.Callback):
    """Makes a Lightning fit collaborative: one ``peer.Optimizer`` around the module's optimizer.

    Args:
        dht: a running ``peer.DHT``.
        swarm_epochs: stop fitting once the swarm has completed this many epochs (None: run
            as Lightning's own limits say).
        **optimizer_kwargs: for ``peer.Optimizer`` (``run_id``, ``target_batch_size``, ...).
    """

    def __init__(self, *, dht: peer.DHT, swarm_epochs: int | None = None, **optimizer_kwargs):
        self.dht, self.swarm_epochs, self.kwargs = dht, swarm_epochs, optimizer_kwargs
        self.opt: peer.Optimizer | None = None
        self._batch_size = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (inner,) = trainer.optimizers  # the one configure_optimizers returned
        self.opt = peer.Optimizer(dht=self.dht, optimizer=inner, **self.kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._batch_size = len(batch[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.opt.step(batch_size=self._batch_size, loss=trainer.callback_metrics.get("loss"))
        if self.swarm_epochs is not None and self.opt.local_epoch >= self.swarm_epochs:
            trainer.should_stop = True

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.opt is not None:
            self.opt.shutdown()


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def make_data(seed: int) -> TensorDataset:
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(2048, 16, generator=generator)
    return TensorDataset(inputs, inputs @ teacher + 0.1 * torch.randn(2048, 4, generator=generator))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--swarm-epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-for-peers", type=int, default=1)
    parser.add_argument("--save", default=None, help="save the final parameters here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)  # the same initial model on every peer
    module = Regression()
    loader = DataLoader(make_data(args.seed), batch_size=32, shuffle=True)
    with peer.DHT(initial_peers=args.initial_peers) as dht:
        print(f"initial peers: {(dht.urls or args.initial_peers)[0]}", flush=True)
        callback = SwarmCallback(
            dht=dht,
            swarm_epochs=args.swarm_epochs,
            run_id="lightning",
            target_batch_size=256,
            matchmaking_time=3.0,
            averaging_timeout=10.0,
            wait_for_peers=args.wait_for_peers,
            verbose=True,
        )
        trainer = L.Trainer(
            max_epochs=1000,
            accelerator="cpu",
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
        stats = callback.opt.stats
        result = {
            "epoch": callback.opt.local_epoch,
            "rounds_with_others": sum(o.num_peers >= 2 for o in stats.history),
        }
    if args.save:
        torch.save([p.detach() for p in module.parameters()], args.save)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
