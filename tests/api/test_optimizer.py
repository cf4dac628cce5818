"""peer.DHT and peer.Optimizer in one process (real HTTP servers on loopback): addresses, the
scheduler following swarm epochs, state dicts, the phases of a user's loop, and a newcomer
loading the swarm's state."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import peer
from dht.config import get_dht_time
from dht.errors import TransportError
from tests.helpers.digests import assert_equal_lately

pytestmark = pytest.mark.timeout(120)


def make_opt(dht, net, **changes):
    kwargs = dict(
        dht=dht,
        run_id="inproc",
        target_batch_size=32,
        batch_size_per_step=8,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        params=net.parameters(),
        publish_interval=0.2,
        summary=False,
    )
    return peer.Optimizer(**{**kwargs, **changes})


def train_steps(opt, model, num_steps: int, batches=None) -> None:
    batches = batches if batches is not None else (torch.randn(8, 4) for _ in range(num_steps))
    for inputs in batches:
        model(inputs).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_dht_addresses_multiaddrs_and_shutdown():
    first = peer.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with first:
        assert first.urls == [first.address]
        port = first.address.rsplit(":", 1)[1]
        # multiaddr objects, as hivemind's (tests/compat checks what scripts do with them)
        assert [str(m) for m in first.get_visible_maddrs()] == [f"/ip4/127.0.0.1/tcp/{port}"]
        with peer.DHT(initial_peers=[f"/ip4/127.0.0.1/tcp/{port}/p2p/QmWhatever"]) as second:
            assert second.peer_id != first.peer_id
            assert second.store("key", "value", get_dht_time() + 30)
            assert first.get("key", latest=True).value == "value"
        assert not second.is_alive()
        second.shutdown()  # twice is fine
        with peer.DHT(client_mode=True, initial_peers=first.urls) as client:
            assert client.address is None and client.urls == []


def test_identity_file_and_swarm_key(tmp_path):
    key_file = tmp_path / "id.key"
    with peer.DHT(identity_path=key_file) as dht:
        peer_id = dht.peer_id
    with peer.DHT(identity_path=key_file) as dht:
        assert dht.peer_id == peer_id  # the same identity from the same file
    key = "a swarm secret of 32 bytes......"
    with peer.DHT(swarm_key=key) as private:
        with peer.DHT(swarm_key=key.encode(), initial_peers=private.urls) as member:
            assert member.store("k", 1, get_dht_time() + 30)
            assert private.get("k", latest=True).value == 1
        with pytest.raises(TransportError):  # without the key nobody answers it
            peer.DHT(swarm_key="another secret of 32 bytes......", initial_peers=private.urls)


def test_the_scheduler_and_state_dict_follow_swarm_epochs():
    model = torch.nn.Linear(4, 2)
    factory = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    with peer.DHT() as dht, make_opt(dht, model, scheduler=factory) as opt:
        train_steps(opt, model, 24)  # alone: an epoch every 32 samples
        assert opt.local_epoch >= 3
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**opt.local_epoch)
        saved_epoch = opt.local_epoch
        state = opt.state_dict()
        assert state["state"]["local_epoch"] == saved_epoch
        train_steps(opt, model, 16)
        assert opt.local_epoch >= saved_epoch + 2
        opt.load_state_dict(state)  # back to the checkpoint: its epoch and its LR
        assert opt.local_epoch == saved_epoch and opt.scheduler.last_epoch == saved_epoch
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**saved_epoch)
        train_steps(opt, model, 8)
        assert opt.local_epoch >= saved_epoch + 1
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**opt.local_epoch)


def test_profile_charges_the_loop_phases():
    model = torch.nn.Linear(4, 2)

    def slow_batches(n):
        for _ in range(n):
            time.sleep(0.05)  # a slow loader
            yield torch.randn(8, 4)

    with peer.DHT() as dht, make_opt(dht, model) as opt:
        clock = opt.session.profiler.clock
        before = clock.snapshot().seconds
        train_steps(opt, model, 0, batches=peer.profile(slow_batches(10)))
        after = clock.snapshot().seconds
    spent = {phase: after[phase] - before[phase] for phase in after}
    # each wait for a batch, at least the loader's sleep (a wait for a CPU meanwhile, on a busy
    # host, is cpu_wait)
    assert spent["data"] + spent["cpu_wait"] >= 10 * 0.05
    for phase in ("forward", "backward", "optimizer"):
        assert spent[phase] > 0, (phase, spent)


def test_a_newcomer_loads_the_swarms_state():
    first_model, stop = torch.nn.Linear(4, 2), threading.Event()
    with peer.DHT() as first_dht, make_opt(first_dht, first_model) as first:

        def train_first():
            while not stop.is_set():
                train_steps(first, first_model, 1)

        thread = threading.Thread(target=train_first)
        thread.start()
        try:
            while first.local_epoch < 5:
                time.sleep(0.05)
            torch.manual_seed(123)
            model = torch.nn.Linear(4, 2)  # other initial parameters than the swarm's
            with peer.DHT(initial_peers=first_dht.urls) as dht, make_opt(dht, model) as opt:
                # downloaded at construction if the swarm's records already said epoch >= 5
                # (they are published every 0.2 s), else when its first steps see it behind
                for _ in range(500):
                    if opt.local_epoch >= 5:
                        break
                    train_steps(opt, model, 1)
                assert opt.local_epoch >= 5
                assert opt.stats.num_rounds < 5  # it got there by loading, not by training
                stop.set()  # the first peer's last epoch is now the newest state there is
                thread.join(timeout=30)
                reached = first.local_epoch
                # the donor announces its last epoch's digest a moment after the epoch (at
                # least 0.5 s after its previous announcement, later on a loaded host): a load
                # before that finds nobody vouching for the state, and says False
                deadline = time.monotonic() + 20
                while not opt.load_state_from_peers():
                    assert time.monotonic() < deadline, "the state never loaded"
                    time.sleep(0.5)
                assert opt.local_epoch >= reached
        finally:
            stop.set()
            thread.join(timeout=30)


def batch_norm_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def test_with_model_the_state_a_newcomer_loads_includes_buffers():
    """``model=``: the served state is the module's state dict, so BatchNorm's running
    statistics (buffers, not parameters) reach a newcomer as they do between ``peer join``
    peers."""
    first_model = batch_norm_model()
    with peer.DHT() as first_dht:
        first = make_opt(first_dht, first_model, model=first_model)
        with first:
            while first.local_epoch < 3:
                train_steps(first, first_model, 1)
            # idle now: the state it serves is the one of epoch 3, which it holds
            torch.manual_seed(7)
            model = batch_norm_model()  # other parameters and fresh running statistics
            with peer.DHT(initial_peers=first_dht.urls) as dht:
                opt = make_opt(dht, model, model=model)
                with opt:
                    # the first peer's record may still say an older epoch (it publishes on a
                    # period) and it serves its newest state once it held it a moment
                    # (peer.swarm.digest_schedule.LINGER_S): ask again until it is there
                    deadline = time.monotonic() + 30
                    while opt.local_epoch != 3 and time.monotonic() < deadline:
                        opt.load_state_from_peers()
                    assert opt.local_epoch == 3
                    theirs = first_model.state_dict()
                    assert set(model.state_dict()) == set(theirs)
                    for name, tensor in model.state_dict().items():
                        assert torch.equal(tensor, theirs[name]), name
                    assert int(theirs["1.num_batches_tracked"]) >= 12


def scrape(dht) -> str:
    with urllib.request.urlopen(f"{dht.address}/metrics", timeout=10) as response:
        return response.read().decode()


def test_serve_metrics_shows_the_attached_optimizers_counters():
    with peer.DHT(serve_metrics=True) as dht:
        assert "vp_peer_info" in scrape(dht) and "vp_epoch" not in scrape(dht)
        model = torch.nn.Linear(4, 2)
        with make_opt(dht, model) as opt:
            while opt.local_epoch < 1:
                train_steps(opt, model, 1)
            text = scrape(dht)
            assert 'run_id="inproc"' in text and "vp_epoch 1.0" in text
            assert "vp_samples_total" in text and "vp_rounds_total 1.0" in text
        assert "vp_epoch" not in scrape(dht)  # the optimizer left; the DHT serves on
    with peer.DHT() as dht:  # off by default
        with pytest.raises(urllib.error.HTTPError, match="404"):
            scrape(dht)


def test_it_is_a_torch_optimizer_for_code_that_takes_one():
    model = torch.nn.Linear(4, 2)
    with peer.DHT() as dht, make_opt(dht, model) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        for _ in range(3):
            train_steps(opt, model, 1)
            scheduler.step()  # a per-step schedule the user chose: it sets the wrapped LR
        assert opt.opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)

        def closure():
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            return loss

        assert isinstance(opt.step(closure), torch.Tensor)  # as torch's step(closure)
        with pytest.raises(ValueError, match="add_param_group"):
            opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("delayed", [False, True], ids=["grad", "delay_optimizer_step"])
def test_a_library_peer_whose_replica_differs_resyncs(delayed):
    # two library peers in grad mode, same initial parameters; the second one's are moved
    # after construction: the averaged gradients keep the difference for good unless it
    # re-syncs. Delayed, the state of an epoch is the one after the round in flight as it
    # began, and a decision comes a round later: 40 epochs
    num_epochs = 40 if delayed else 30
    models = []
    for _ in range(2):
        torch.manual_seed(7)
        models.append(torch.nn.Linear(4, 2))
    stop, errors = threading.Event(), []
    with peer.DHT() as first_dht, peer.DHT(initial_peers=first_dht.urls) as second_dht:
        opts: list = [None, None]

        def build(index, dht):  # each waits for the other: they start at the same epoch
            opts[index] = make_opt(
                dht,
                models[index],
                target_batch_size=256,
                wait_for_peers=2,
                delay_optimizer_step=delayed,
            )

        builders = [
            threading.Thread(target=build, args=p) for p in enumerate((first_dht, second_dht))
        ]
        for thread in builders:
            thread.start()
        for thread in builders:
            thread.join(timeout=60)
        try:
            for opt in opts:  # look at the announcements often in this short run
                replicas = opt.session.state.replicas
                replicas.config = dataclasses.replace(replicas.config, resync_check_s=0.2)
            with torch.no_grad():
                models[1].weight.add_(1e-3)

            def train(opt, model):
                try:
                    while not stop.is_set() and opt.local_epoch < num_epochs:
                        time.sleep(0.01)  # epochs of about 0.2 s: a few per look
                        train_steps(opt, model, 1)
                except Exception as e:  # said by the test below
                    errors.append(e)

            threads = [
                threading.Thread(target=train, args=pair) for pair in zip(opts, models, strict=True)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=90)
        finally:
            stop.set()
            for opt in opts:
                if opt is not None:
                    opt.shutdown()
    assert not errors
    assert sorted(min(opt.session.state.num_resyncs, 1) for opt in opts) == [0, 1]
    digests = [
        {d.epoch: d.digest for d in opt.session.services.state_server.digests} for opt in opts
    ]
    assert_equal_lately(digests)
