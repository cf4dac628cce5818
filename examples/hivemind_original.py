"""A training script written against hivemind's documented API (hivemind 1.1.12 quickstart).

``examples/hivemind_converted.py`` is this file with only the import line changed
(``import hivemind`` -> ``import peer as hivemind``): it then runs on Volunteer Peer.

    python examples/hivemind_original.py --seconds 30
    python examples/hivemind_original.py --seconds 30 --initial-peers ADDRESS_PRINTED_ABOVE
"""

import argparse
import json
import time

import hivemind
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--initial-peers", nargs="*", default=[])
parser.add_argument("--seconds", type=float, default=30.0)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--target-batch-size", type=int, default=512)
parser.add_argument("--save", default=None)
args = parser.parse_args()

# the data: a noisy linear teacher, a different sample per peer
teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(args.seed))
dataset = TensorDataset(inputs, inputs @ teacher + 0.1 * torch.randn(2048, 4))
loader = DataLoader(dataset, batch_size=32, shuffle=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

dht = hivemind.DHT(
    initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
)
print("To join the training, use initial_peers =", [str(a) for a in dht.get_visible_maddrs()])
print(flush=True)

opt = hivemind.Optimizer(
    dht=dht,  # use a DHT that is connected with other peers
    run_id="my_cifar_run",  # unique identifier of this collaborative run
    batch_size_per_step=32,  # each call to opt.step adds this many samples towards the next epoch
    target_batch_size=args.target_batch_size,  # after peers process this many samples, average
    optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),  # wrap a torch optimizer
    params=model.parameters(),
    use_local_updates=False,  # accumulate gradients; average them at each epoch's end
    matchmaking_time=3.0,  # when averaging parameters, gather peers in background for up to this
    averaging_timeout=10.0,  # give up on averaging if not successful in this many seconds
    verbose=True,  # print logs incessently
)

deadline = time.monotonic() + args.seconds
losses = []
while time.monotonic() < deadline:
    for x_batch, y_batch in loader:
        opt.zero_grad()
        loss = F.mse_loss(model(x_batch), y_batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if time.monotonic() >= deadline:
            break

print(json.dumps({"local_epoch": opt.local_epoch, "first": losses[0], "last": losses[-1]}))
opt.shutdown()
dht.shutdown()
if args.save:
    torch.save(model.state_dict(), args.save)
