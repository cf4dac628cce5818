"""``peer.Optimizer`` driven as hivemind's ``tests/test_optimizer.py::test_optimizer`` drives
``hivemind.Optimizer`` (its eight configurations, written here in its style: a trainer with its
own DHT joins a swarm, passes tracker_opts and averager_opts, loads the state, trains three
epochs, shuts down), without its sleeps between batches."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from peer import DHT, Optimizer

pytestmark = pytest.mark.timeout(60)


class PrivateKeyStandIn:
    """What hivemind's tests pass as ``tracker_opts["private_key"]`` (an RSA key object)."""


@pytest.fixture(scope="module")
def dht():
    with DHT(start=True) as node:
        yield node


CASES = [  # use_local_updates, delay_state_averaging, delay_optimizer_step,
    # delay_grad_averaging, reuse_grad_buffers: hivemind's parametrization
    (False, False, False, False, False),
    (False, True, False, False, False),
    (False, True, True, True, False),
    (False, False, False, False, True),
    (False, True, True, True, True),
    (False, True, True, False, True),
    (True, False, False, False, False),
    (True, True, False, False, False),
]


@pytest.mark.parametrize(
    "use_local_updates, delay_state_averaging, delay_optimizer_step, delay_grad_averaging, "
    "reuse_grad_buffers",
    CASES,
)
def test_optimizer(
    dht,
    use_local_updates,
    delay_state_averaging,
    delay_optimizer_step,
    delay_grad_averaging,
    reuse_grad_buffers,
):
    torch.manual_seed(0)
    target_batch_size, total_epochs, batch_size = 32, 3, 4
    features = torch.randn(100, 5)
    targets = features @ torch.randn(5, 1)
    model = nn.Linear(5, 1)
    before = [p.detach().clone() for p in model.parameters()]
    run_id = "compat_" + "".join(str(int(flag)) for flag in (
        use_local_updates, delay_state_averaging, delay_optimizer_step, delay_grad_averaging,
        reuse_grad_buffers))  # fmt: skip
    optimizer = Optimizer(
        run_id=run_id,
        target_batch_size=target_batch_size,
        batch_size_per_step=batch_size,
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        scheduler=partial(torch.optim.lr_scheduler.StepLR, gamma=0.5, step_size=1),
        dht=DHT(initial_peers=dht.get_visible_maddrs(), client_mode=False, start=True),
        tracker_opts=dict(private_key=PrivateKeyStandIn(), max_refresh_period=1.0),
        averager_opts=dict(request_timeout=0.5),
        use_local_updates=use_local_updates,
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        reuse_grad_buffers=reuse_grad_buffers,
        delay_state_averaging=delay_state_averaging,
        delay_grad_averaging=delay_grad_averaging,
        delay_optimizer_step=delay_optimizer_step,
        average_state_every=1,
        client_mode=False,
        verbose=False,
        summary=False,
    )
    try:
        optimizer.load_state_from_peers()
        total_samples_accumulated = 0
        while optimizer.local_epoch < total_epochs:
            batch = torch.randint(0, len(features), (batch_size,))
            loss = F.mse_loss(model(features[batch]), targets[batch])
            loss.backward()
            optimizer.step()
            total_samples_accumulated += batch_size
            if not reuse_grad_buffers:
                optimizer.zero_grad()
    finally:
        optimizer.shutdown()
        optimizer.dht.shutdown()

    assert isinstance(optimizer, Optimizer)
    assert optimizer.local_epoch == total_epochs
    expected_samples_accumulated = target_batch_size * total_epochs
    assert expected_samples_accumulated <= total_samples_accumulated
    assert total_samples_accumulated <= expected_samples_accumulated * 1.2
    # the scheduler stepped once per epoch (StepLR, gamma 0.5), and the model trained
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**total_epochs)
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
