"""Every argument error of ``peer.DHT`` and ``peer.Optimizer``: a hivemind argument with no
equivalent is accepted with one INFO line saying what is done instead, unless ignoring it would
change the result (then a TypeError naming it and what to use instead); an argument hivemind does
not have either is a TypeError; a bad value is a ValueError naming the argument. Nothing is left
running after an error (the DHT stays usable)."""

from __future__ import annotations

import logging

import pytest
import torch

import peer
from dht.identity import PeerIdentity

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def dht():
    with peer.DHT() as node:
        yield node


@pytest.fixture
def model():
    return torch.nn.Linear(4, 2)


def make(node, model, **changes):
    kwargs = dict(
        dht=node,
        run_id="args",
        target_batch_size=64,
        batch_size_per_step=8,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        params=model.parameters(),
        summary=False,
    )
    return peer.Optimizer(**{**kwargs, **changes})


REFUSED = [  # ignoring these would change the result
    ("average_state_every", 2, "every epoch"),
    ("auxiliary", True, "client_mode=True"),
    ("grad_averager_factory", object(), "mode="),
    ("average_opt_statistics", ("exp_avg",), "stay local"),
    ("extra_tensors", (torch.zeros(1),), "only parameters"),
    ("averager_opts", {"averaging_alpha": 0.5}, "average replaces"),
    ("averager_opts", {"auxiliary": True}, "client_mode=True"),
]


@pytest.mark.parametrize(("name", "value", "instead"), REFUSED)
def test_a_hivemind_argument_whose_effect_we_lack_is_a_type_error_saying_what_instead(
    dht, model, name, value, instead
):
    with pytest.raises(TypeError, match=name) as error:
        make(dht, model, **{name: value})
    assert instead in str(error.value)


ACCEPTED = [  # no effect here; one INFO line names the argument and what is done instead
    ({"allreduce_timeout": 5.0}, "allreduce_timeout", "averaging_timeout"),
    ({"next_chunk_timeout": 3.0}, "next_chunk_timeout", "transport"),
    ({"offload_optimizer": True}, "offload_optimizer", "parameters are"),
    ({"delay_state_averaging": False}, "delay_state_averaging", "within step()"),
    ({"performance_ema_alpha": 0.5}, "performance_ema_alpha", "between progress records"),
    ({"averager_opts": {"bandwidth": 1e8}}, "bandwidth", "split evenly"),
    ({"averager_opts": {"request_timeout": 0.5}}, "request_timeout", "transport"),
    ({"tracker_opts": {"min_refresh_period": 1}}, "min_refresh_period", "publish_interval="),
    ({"tracker_opts": {"max_refresh_period": 1.0}}, "max_refresh_period", "publish_interval="),
]


@pytest.mark.parametrize(("changes", "name", "instead"), ACCEPTED)
def test_a_hivemind_argument_without_effect_here_is_accepted_with_one_info_line(
    dht, model, caplog, changes, name, instead
):
    caplog.set_level(logging.INFO, logger="peer.api.errors")
    with make(dht, model, **changes) as opt:
        assert opt.local_epoch == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "peer.api.errors"]
    assert len(lines) == 1, lines
    assert name in lines[0] and instead in lines[0]


def test_averager_opts_group_sizes_are_ours(dht, model):
    with make(dht, model, averager_opts={"target_group_size": 3, "min_group_size": 2}) as opt:
        assert (opt.config.target_group_size, opt.config.min_group_size) == (3, 2)
    with pytest.raises(ValueError, match="target_group_size"):
        make(dht, model, target_group_size=4, averager_opts={"target_group_size": 3})


def test_keys_neither_hivemind_nor_we_have_are_type_errors(dht, model):
    with pytest.raises(TypeError, match="'no_such_option'"):
        make(dht, model, averager_opts={"no_such_option": 1})
    with pytest.raises(TypeError, match="'refresh'"):
        make(dht, model, tracker_opts={"refresh": 1})
    with pytest.raises(ValueError, match="tracker_opts"):
        make(dht, model, tracker_opts=[("max_refresh_period", 1)])


def test_delay_grad_averaging_is_hiveminds(dht, model):
    """hivemind: delay_grad_averaging needs delay_optimizer_step, which defaults to it."""
    with make(dht, model, delay_grad_averaging=True) as opt:
        assert opt.config.delay_update
    with make(dht, model, delay_grad_averaging=True, delay_optimizer_step=True) as opt:
        assert opt.config.delay_update
    with pytest.raises(ValueError, match="delay_grad_averaging"):
        make(dht, model, delay_grad_averaging=True, delay_optimizer_step=False)


def test_reuse_grad_buffers_takes_a_delayed_step(dht, model):
    with make(dht, model, reuse_grad_buffers=True, delay_optimizer_step=True) as opt:
        assert opt.config.delay_update


def test_an_unknown_argument_is_a_type_error(dht, model):
    with pytest.raises(TypeError, match="'learning_rate'"):
        make(dht, model, learning_rate=0.1)


BAD_VALUES = [
    ({"dht": "http://127.0.0.1:1"}, "dht"),
    ({"run_id": "no spaces allowed"}, "run_id"),
    ({"run_id": ""}, "run_id"),
    ({"target_batch_size": 0}, "target_batch_size"),
    ({"batch_size_per_step": 0}, "batch_size_per_step"),
    ({"batch_size_per_step": 2.5}, "batch_size_per_step"),
    ({"optimizer": 3}, "optimizer"),
    ({"optimizer": lambda params: params}, "optimizer"),
    ({"params": None}, "params"),
    ({"params": []}, "params"),
    ({"scheduler": 3}, "scheduler"),
    ({"matchmaking_time": -1.0}, "matchmaking_time"),
    ({"averaging_timeout": 0}, "averaging_timeout"),
    ({"load_state_timeout": 0}, "load_state_timeout"),
    ({"use_local_updates": True, "mode": "grad"}, "use_local_updates"),
    ({"mode": "async"}, "mode"),
    ({"client_mode": True}, "client_mode"),
    ({"grad_compression": "zip"}, "grad_compression"),
    ({"grad_compression": object()}, "grad_compression"),
    ({"state_averaging_compression": "fp16"}, "state_averaging_compression"),
    ({"load_state_compression": "fp16"}, "load_state_compression"),
    ({"delay_optimizer_step": True, "mode": "diloco"}, "delay_optimizer_step"),
    ({"reuse_grad_buffers": True, "use_local_updates": True}, "reuse_grad_buffers"),
    ({"outer_lr": -0.1}, "outer_lr"),
    ({"outer_momentum": "high"}, "outer_momentum"),
    ({"shutdown_timeout": 0}, "shutdown_timeout"),
    ({"target_group_size": 0}, "target_group_size"),
    ({"min_group_size": 0}, "min_group_size"),
    ({"publish_interval": 0}, "publish_interval"),
    ({"lr_schedule": "exponential"}, "lr_schedule"),
    ({"metrics_file": 3}, "metrics_file"),
    ({"trace": 3}, "trace"),
    ({"warmup_epochs": -1}, "warmup_epochs"),
]


@pytest.mark.parametrize(("changes", "name"), BAD_VALUES)
def test_a_bad_value_is_a_value_error_naming_the_argument(dht, model, changes, name):
    with pytest.raises(ValueError, match=name):
        make(dht, model, **changes)


@pytest.mark.parametrize("module", ["net", torch.nn.Linear(4, 2)], ids=["not-a-module", "other"])
def test_model_must_be_the_module_of_the_optimizers_parameters(dht, model, module):
    with pytest.raises(ValueError, match="model"):
        peer.Optimizer(
            dht=dht,
            run_id="args",
            target_batch_size=64,
            batch_size_per_step=8,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            model=module,
            summary=False,
        )


def test_an_optimizer_instance_takes_no_params(dht, model):
    with pytest.raises(ValueError, match="params"):
        make(dht, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_scheduler_and_lr_schedule_exclude_each_other(dht, model):
    factory = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)  # noqa: E731
    with pytest.raises(ValueError, match="scheduler"):
        make(dht, model, scheduler=factory, lr_schedule="cosine", schedule_epochs=10)


def test_step_and_zero_grad_errors(dht, model):
    with make(dht, model, batch_size_per_step=None) as opt:
        with pytest.raises(ValueError, match="batch_size"):
            opt.step()
        with pytest.raises(ValueError, match="batch_size"):
            opt.step(batch_size=-1)
        with pytest.raises(TypeError, match="grad_scaler"):
            opt.step(batch_size=8, grad_scaler=object())
        with pytest.raises(ValueError, match="dht"):  # one optimizer per DHT
            make(dht, model, run_id="other")
    with make(dht, model, reuse_grad_buffers=True) as opt:
        with pytest.raises(ValueError, match="reuse_grad_buffers"):
            opt.zero_grad()
    with pytest.raises(RuntimeError, match="shutdown"):
        opt.step()


def test_hivemind_defaults_passed_explicitly_are_accepted(dht, model):
    defaults = dict(
        allreduce_timeout=None,
        next_chunk_timeout=None,
        offload_optimizer=None,
        delay_grad_averaging=False,
        delay_state_averaging=True,
        average_state_every=1,
        auxiliary=False,
        grad_averager_factory=None,
        average_opt_statistics=(),
        extra_tensors=(),
        averager_opts=None,
        tracker_opts=None,
        performance_ema_alpha=0.1,
        reuse_grad_buffers=False,
        delay_optimizer_step=None,
        use_local_updates=False,
        client_mode=None,
        shutdown_timeout=5,
        verbose=False,
    )
    with make(dht, model, **defaults) as opt:
        assert opt.local_epoch == 0


DHT_UNSUPPORTED = [  # ignoring these would change the result, or hivemind has no such argument
    ({"use_ipfs": True}, "use_ipfs"),
    ({"record_validators": [object()]}, "record_validators"),
    ({"authorizer": object()}, "authorizer"),
    ({"no_such_option": 1}, "no_such_option"),
]


@pytest.mark.parametrize(("changes", "name"), DHT_UNSUPPORTED)
def test_dht_unsupported_arguments_are_type_errors(changes, name):
    with pytest.raises(TypeError, match=name):
        peer.DHT(**changes)


DHT_BAD_VALUES = [
    ({"port": 70000}, "port"),
    ({"port": "80"}, "port"),
    ({"host": ""}, "host"),
    ({"initial_peers": "http://127.0.0.1:1"}, "initial_peers"),
    ({"initial_peers": ["localhost"]}, "initial_peers"),
    ({"host_maddrs": ["/ip4/127.0.0.1/udp/1"]}, "host_maddrs"),
    ({"initial_peers": ["/ip4/127.0.0.1/udp/1/quic"]}, "initial_peers"),
    ({"wait_timeout": 0}, "wait_timeout"),
    ({"announce_maddrs": ["nowhere"]}, "announce_maddrs"),
    ({"swarm_key": 3}, "swarm_key"),
    ({"swarm_key": "short"}, "swarm_key"),
    ({"identity": "id.key"}, "identity"),
    ({"identity": PeerIdentity.generate(), "identity_path": "id.key"}, "identity"),
    ({"serve_metrics": "yes"}, "serve_metrics"),
]


@pytest.mark.parametrize(("changes", "name"), DHT_BAD_VALUES)
def test_dht_bad_values_are_value_errors(changes, name):
    with pytest.raises(ValueError, match=name):
        peer.DHT(**changes)
