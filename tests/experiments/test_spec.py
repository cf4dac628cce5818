"""Experiment files are checked up front: clear one-line errors naming the key, nothing starts."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from experiments.spec import SpecError, cpu_split, expand, load_spec, parse_spec
from tests.experiments.helpers import peer_cli, tiny_spec

pytestmark = pytest.mark.timeout(60)


def spec_dict(extra: str = "", **kwargs) -> dict:
    return tomllib.loads(tiny_spec("t", extra=extra, **kwargs))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("bogus = 1", "bogus: unknown key"),
        ("[grid]\nnope = [1, 2]", "grid.nope: unknown key (grid keys: peers,"),
        ("[grid]\npeers = [0, 2]", "grid.peers: Input should be greater than or equal to 1"),
        ("[grid]\npeers = []", "grid.peers: needs at least one value"),
        ("[grid]\nmode = ['grad', 'bogus']", "grid.mode: Input should be 'grad'"),
        ("[grid]\npeers = [1, 4]", "resources.total_cpus: 4 peers cannot share 2 CPUs"),
        ("[network]\nbandwidth_mbit = 20", "network: shaping links needs launcher = 'netns'"),
        ("[network]\nloss_percent = 150", "network.loss_percent: Input should be less than"),
    ],
)
def test_invalid_specs_name_the_key(extra: str, message: str):
    with pytest.raises(SpecError) as error:
        parse_spec(spec_dict(extra))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("launcher", "extra", "message"),
    [
        ("ssh", "", "ssh.hosts: the ssh launcher needs an inventory"),
        ("pigeon", "", "launcher: Input should be 'local', 'netns', 'ssh' or 'ray'"),
        ("ray", '[ray]\naddress = "head"', 'ray.address: \'head\': give "auto", "HOST:PORT"'),
        ("ray", '[ray]\naddress = "ray://h:99999"', "ray.address: 'ray://h:99999': give"),
        ("ray", '[ray]\nplacement = "scatter"', "ray.placement: Input should be 'spread' or"),
        ("ray", "[ray]\nready_timeout_s = 0", "ray.ready_timeout_s: Input should be greater"),
        ("local", "[ray]\naddress = 'auto'", "ray: a [ray] table is given but launcher = 'local'"),
        (
            "netns",
            "[[network.groups]]\npeers = [5]\nlatency_ms = 10",
            "network.groups[0].peers: peer 5 does not exist",
        ),
    ],
)
def test_invalid_launcher_settings(launcher: str, extra: str, message: str):
    with pytest.raises(SpecError) as error:
        parse_spec(spec_dict(extra, launcher=launcher))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_unknown_key_inside_a_table():
    data = spec_dict()
    data["seeds"] = [1, 1]
    with pytest.raises(SpecError, match=r"^seeds: values repeat$"):
        parse_spec(data)
    data["seeds"] = [1]
    data["train"]["learning_rate"] = 0.1
    with pytest.raises(SpecError, match=r"^train\.learning_rate: unknown key$"):
        parse_spec(data)


def test_impossible_resources():
    data = spec_dict()
    data["resources"] = {"total_cpus": (os.cpu_count() or 1) + 1, "pin_cpus": True}
    data["train"]["peers"] = 1
    with pytest.raises(SpecError, match=r"resources\.total_cpus: \d+ CPUs cannot be pinned"):
        parse_spec(data)
    data["stop"] = {"target_loss": 0.5}
    data["resources"] = {"total_cpus": 1}
    with pytest.raises(SpecError, match=r"^stop: give max_time_s or max_epochs"):
        parse_spec(data)


def test_expand_names_every_configuration_and_splits_the_cpus():
    data = spec_dict("[grid]\npeers = [1, 2]\ncompression = ['none', 'fp16']")
    data["seeds"] = [1, 2]
    configs = expand(parse_spec(data))
    assert [c.name for c in configs[:2]] == ["baseline_seed-1", "baseline_seed-2"]
    assert len(configs) == 2 + 2 * 2 * 2
    assert "peers-2_compression-fp16_seed-2" in {c.name for c in configs}
    assert {c.train.peers for c in configs if not c.baseline} == {1, 2}
    assert cpu_split(5, 2) == [[0, 1, 2], [3, 4]]
    assert cpu_split(4, 4) == [[0], [1], [2], [3]]


def test_inventory_file_and_bad_toml(tmp_path: Path):
    (tmp_path / "hosts.toml").write_text('[[hosts]]\nhost = "10.0.0.5"\nuser = "me"\n')
    (tmp_path / "spec.toml").write_text(
        tiny_spec("t", launcher="ssh", extra='[ssh]\ninventory = "hosts.toml"\n')
    )
    spec = load_spec(tmp_path / "spec.toml")
    assert [h.host for h in spec.ssh.hosts] == ["10.0.0.5"]
    (tmp_path / "hosts.toml").write_text('[[hosts]]\nhost = "x"\nbogus = 1\n')
    with pytest.raises(SpecError, match=r"ssh\.inventory\.hosts\[0\]\.bogus: unknown key"):
        load_spec(tmp_path / "spec.toml")
    (tmp_path / "broken.toml").write_text("name = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(tmp_path / "broken.toml")


def test_cli_refuses_a_bad_spec_before_starting_anything(tmp_path: Path):
    spec = tmp_path / "spec.toml"
    spec.write_text(tiny_spec("t", extra="[grid]\npeers = [1, 8]"))
    out = tmp_path / "out"
    result = peer_cli("experiment", "run", str(spec), "--out", str(out), timeout_s=30)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "peer: error: resources.total_cpus: 8 peers cannot share 2 CPUs (every peer needs at "
        "least one)"
    ]
    assert not out.exists()
    missing = peer_cli("experiment", "run", str(tmp_path / "nope.toml"), "--out", str(out),
                       timeout_s=30)  # fmt: skip
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    assert peer_cli("experiment", "report", str(tmp_path), timeout_s=30).returncode == 2


PRESETS = Path(__file__).resolve().parents[2] / "experiments" / "presets"


@pytest.mark.parametrize("name", ["smoke", "study", "wan", "vms"])
def test_presets_are_valid(name: str, tmp_path: Path):
    for path in PRESETS.glob("*.toml"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "hosts.toml").write_text((PRESETS / "hosts.example.toml").read_text())
    data = tomllib.loads((tmp_path / f"{name}.toml").read_text())
    if data["resources"].get("total_cpus", 0) > (os.cpu_count() or 1):
        data["resources"]["pin_cpus"] = False  # a smaller machine than the preset's
    spec = parse_spec(data, base_dir=tmp_path)
    configs = expand(spec)
    assert configs and all(c.train.peers <= spec.resources.total_cpus for c in configs)
    if name == "smoke":
        assert [c.baseline for c in configs] == [True, False, False]
        assert spec.launcher == "local"
    if name == "vms":
        assert len(spec.ssh.hosts) == 2 and spec.ssh.hosts[0].key.is_absolute()


def test_a_network_group_inherits_what_it_does_not_set():
    """``nat = true`` alone keeps the swarm's shaping (it used to leave those peers unshaped)."""
    extra = (
        "[network]\nbandwidth_mbit = 100\nlatency_ms = 20\njitter_ms = 1\n"
        "[[network.groups]]\npeers = [1]\nnat = true\n"
        "[[network.groups]]\npeers = [2]\nlatency_ms = 5\njitter_ms = 0\n"
    )
    data = spec_dict(extra, launcher="netns")
    data["train"]["peers"] = 3
    data["resources"]["total_cpus"] = 3
    network = parse_spec(data).network
    swarm = network.link_for(0)
    assert (swarm.bandwidth_mbit, swarm.latency_ms, swarm.jitter_ms) == (100, 20, 1)
    assert network.link_for(1) == swarm
    assert network.behind_nat(1) and not network.behind_nat(0)
    own = network.link_for(2)
    assert (own.bandwidth_mbit, own.latency_ms, own.jitter_ms) == (100, 5, 0)
    # a group's own setting wins, even when it turns shaping off for its peers
    data["network"] = {"latency_ms": 20, "groups": [{"peers": [2], "latency_ms": 0}]}
    assert not parse_spec(data).network.link_for(2).needs_netem


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", "head.lan:6379", "ray://[::1]:10001"])
def test_ray_addresses(address: str):
    spec = parse_spec(spec_dict(f"[ray]\naddress = {address!r}", launcher="ray"))
    assert spec.ray.address == address
    data = spec_dict(launcher="ray")
    data["resources"]["gpus"] = [0]
    with pytest.raises(SpecError, match=r"^resources\.gpus: the ray launcher places CPUs only"):
        parse_spec(data)
