"""What the runner asks launchers to start: CPU split, threads, GPUs, seeds; tc commands."""

from __future__ import annotations

import tomllib

import pytest

from experiments.launch.netns import shaping_commands
from experiments.runner import baseline_plan, bootstrap_plan, peer_plans
from experiments.spec import LinkSpec, expand, parse_spec
from tests.experiments.helpers import tiny_spec

pytestmark = pytest.mark.timeout(30)


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_peers_split_the_cpus_and_the_baseline_gets_them_all():
    data = tomllib.loads(tiny_spec("p"))
    data["seeds"] = [3]
    data["resources"] = {"total_cpus": 2, "pin_cpus": True, "gpus": [0, 1], "env": {"A": "1"}}
    data["train"] |= {"backend": "hivemind", "compression": "fp16", "join_args": ["--amp", "off"]}
    spec = parse_spec(data)
    baseline, swarm = expand(spec)
    plans = peer_plans(spec, swarm)
    assert [p.cpus for p in plans] == [[0], [1]]
    assert [p.env for p in plans] == [
        {"A": "1", "CUDA_VISIBLE_DEVICES": "0"},
        {"A": "1", "CUDA_VISIBLE_DEVICES": "1"},
    ]
    for index, plan in enumerate(plans):
        assert plan.args[:5] == ["-m", "peer", "--log-level", "INFO", "join"]
        assert _value(plan.args, "--torch-threads") == "1"
        assert _value(plan.args, "--wait-for-peers") == "2"
        assert _value(plan.args, "--seed") == str(3000 + index)
        assert _value(plan.args, "--backend") == "hivemind"
        assert _value(plan.args, "--compression") == "fp16"
        assert _value(plan.args, "--device") == "cuda"
        assert _value(plan.args, "--max-time") == "5.0"
        assert plan.args[-2:] == ["--amp", "off"]
        assert "batch_size=32" in plan.args and "hidden_dim=32" in plan.args
    assert bootstrap_plan(swarm).args == ["-m", "experiments.hivemind_dht"]
    base = baseline_plan(spec, baseline)
    assert base.cpus == [0, 1] and _value(base.args, "--torch-threads") == "2"
    assert _value(base.args, "--target-batch-size") == "256" and not base.listens


def test_shaping_puts_the_rate_limiter_under_netem():
    both = shaping_commands("eth0", LinkSpec(bandwidth_mbit=20, latency_ms=10, jitter_ms=1))
    assert both[0][:6] == ["qdisc", "add", "dev", "eth0", "root", "handle"]
    assert "netem" in both[0] and "10.0ms" in both[0] and "1.0ms" in both[0]
    assert both[1][4:7] == ["parent", "1:", "handle"] and "tbf" in both[1]
    assert both[1][both[1].index("rate") + 1] == "20.0mbit"
    rate_only = shaping_commands("v0", LinkSpec(bandwidth_mbit=20))
    assert len(rate_only) == 1 and rate_only[0][4] == "root" and "netem" not in rate_only[0]
    assert shaping_commands("v0", LinkSpec()) == []
