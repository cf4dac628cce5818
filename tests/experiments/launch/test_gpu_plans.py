"""GPU assignment in the process plans: round-robin CUDA_VISIBLE_DEVICES and ``--device cuda``
(the plans only: no GPU is needed)."""

from __future__ import annotations

import tomllib

import pytest

from experiments.runner import baseline_plan, peer_plans
from experiments.spec import expand, parse_spec
from tests.experiments.helpers import tiny_spec

pytestmark = pytest.mark.timeout(30)


def _spec(gpus: list[int], num_peers: int):
    data = tomllib.loads(tiny_spec("g"))
    data["train"]["peers"] = num_peers
    data["resources"] = {"total_cpus": num_peers, "pin_cpus": False, "gpus": gpus}
    return parse_spec(data)


def _device(args: list[str]) -> str | None:
    return args[args.index("--device") + 1] if "--device" in args else None


def test_peers_take_the_gpus_round_robin_each_on_cuda():
    spec = _spec([0, 1], num_peers=5)
    baseline, swarm = expand(spec)
    plans = peer_plans(spec, swarm)
    assert [p.env.get("CUDA_VISIBLE_DEVICES") for p in plans] == ["0", "1", "0", "1", "0"]
    assert [_device(p.args) for p in plans] == ["cuda"] * 5
    assert [p.args.count("--device") for p in plans] == [1] * 5
    base = baseline_plan(spec, baseline)
    assert base.env.get("CUDA_VISIBLE_DEVICES") == "0" and _device(base.args) == "cuda"


def test_gpu_ids_are_used_as_given():
    spec = _spec([3, 1], num_peers=3)
    plans = peer_plans(spec, expand(spec)[1])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["3", "1", "3"]


def test_without_gpus_no_device_is_forced():
    spec = _spec([], num_peers=2)
    baseline, swarm = expand(spec)
    for plan in [*peer_plans(spec, swarm), baseline_plan(spec, baseline)]:
        assert "CUDA_VISIBLE_DEVICES" not in plan.env
        assert _device(plan.args) is None
