"""The experiment file (TOML): what to run, on what resources and network, until when.

:func:`load_spec` reads and checks a file up front; every mistake is one :class:`SpecError` line
naming the key (``grid.peers: ...``), before anything starts. :func:`expand` turns a spec into
the configurations of the sweep: the grid's cross product times the seeds, plus one single-node
baseline per seed. See ``docs/EXPERIMENTS.md`` for the format and ``experiments/presets/``.

Owns: the file's tables (:mod:`experiments.spec.models`), reading, checking and expanding them.
May import: nothing of the project (a base room that every other room of ``experiments`` reads).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from experiments.spec.models import (
    GRID_KEYS,
    CalibrationSpec,
    ExperimentSpec,
    HostSpec,
    LinkSpec,
    NetworkGroup,
    NetworkSpec,
    RaySpec,
    ResourcesSpec,
    SpecError,
    SshSpec,
    StopSpec,
    TaskSpec,
    TrainSpec,
)

__all__ = [
    "GRID_KEYS",
    "CalibrationSpec",
    "ExperimentSpec",
    "HostSpec",
    "LinkSpec",
    "NetworkGroup",
    "NetworkSpec",
    "RaySpec",
    "ResourcesSpec",
    "RunConfig",
    "SpecError",
    "SshSpec",
    "StopSpec",
    "TaskSpec",
    "TrainSpec",
    "cpu_split",
    "expand",
    "load_spec",
    "parse_spec",
    "peer_counts",
]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration of the sweep.

    Attributes:
        name: its directory name (the varying grid values and the seed).
        train: the settings of its peers.
        seed: the repeat's seed (peer i uses ``seed * 1000 + i``).
        baseline: the single-node baseline instead of a swarm.
        grid_values: the grid key -> value of this configuration (empty for the baseline).
        tuning: the calibrated setting its processes run with (``torch_threads``,
            ``wait_policy``, ``num_workers``); None: the defaults (threads = CPUs).
    """

    name: str
    train: TrainSpec
    seed: int
    baseline: bool = False
    grid_values: dict[str, Any] = dataclasses.field(default_factory=dict)
    tuning: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        described = {
            "name": self.name,
            "seed": self.seed,
            "baseline": self.baseline,
            "grid": self.grid_values,
            "train": self.train.model_dump(),
        }
        if self.tuning is not None:
            described["tuning"] = self.tuning
        return described


def _error(e: ValidationError, prefix: str = "") -> SpecError:
    error = e.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    where = f"{prefix}.{where}" if prefix and where else prefix or where or "spec"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return SpecError(f"{where}: {message}")


def parse_spec(data: dict[str, Any], *, base_dir: Path | None = None) -> ExperimentSpec:
    """Check a spec given as the TOML's dictionary.

    Raises:
        SpecError: the first problem, naming its key.
    """
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as e:
        raise _error(e) from None
    if spec.ssh.inventory is not None:
        spec = _with_inventory(spec, base_dir or Path.cwd())
    _check_grid(spec)
    _check_resources(spec)
    _check_network(spec)
    _check_launcher(spec)
    return spec


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and check an experiment file.

    Raises:
        SpecError: unreadable, not TOML, or invalid (the message names the key).
    """
    path = Path(path)
    return parse_spec(_read_toml(path, ""), base_dir=path.parent)


def _read_toml(path: Path, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"{where}cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{where}{path} is not valid TOML: {e}") from None


def _with_inventory(spec: ExperimentSpec, base_dir: Path) -> ExperimentSpec:
    path = spec.ssh.inventory if spec.ssh.inventory.is_absolute() else base_dir / spec.ssh.inventory
    data = _read_toml(path, "ssh.inventory: ")
    hosts = []
    for number, host in enumerate(data.get("hosts", [])):
        try:
            hosts.append(HostSpec.model_validate(host))
        except ValidationError as e:
            raise _error(e, f"ssh.inventory.hosts[{number}]") from None
    ssh = spec.ssh.model_copy(update={"hosts": [*spec.ssh.hosts, *hosts]})
    return spec.model_copy(update={"ssh": ssh})


def _grid_combinations(spec: ExperimentSpec) -> list[dict[str, Any]]:
    keys = list(spec.grid)
    combinations = itertools.product(*spec.grid.values())
    return [dict(zip(keys, values, strict=True)) for values in combinations]


def _check_grid(spec: ExperimentSpec) -> None:
    for key, values in spec.grid.items():
        if key not in GRID_KEYS:
            raise SpecError(f"grid.{key}: unknown key (grid keys: {', '.join(GRID_KEYS)})")
        if not values:
            raise SpecError(f"grid.{key}: needs at least one value")
        if len(set(map(repr, values))) != len(values):
            raise SpecError(f"grid.{key}: values repeat")
    base = spec.train.model_dump()
    for combination in _grid_combinations(spec):
        try:
            TrainSpec.model_validate(base | combination)
        except ValidationError as e:
            raise _error(e, "grid") from None
    if len(set(spec.seeds)) != len(spec.seeds):
        raise SpecError("seeds: values repeat")


def peer_counts(spec: ExperimentSpec) -> list[int]:
    """Every number of peers the sweep runs."""
    return sorted({int(c.get("peers", spec.train.peers)) for c in _grid_combinations(spec)})


def _check_resources(spec: ExperimentSpec) -> None:
    total = spec.resources.total_cpus
    on_this_machine = spec.launcher in ("local", "netns")
    machine = os.cpu_count() or 1
    if on_this_machine and spec.resources.pin_cpus and total > machine:
        raise SpecError(
            f"resources.total_cpus: {total} CPUs cannot be pinned on this machine, which has "
            f"{machine} (lower it, or set resources.pin_cpus = false to oversubscribe)"
        )
    for num_peers in peer_counts(spec):
        if num_peers > total:
            raise SpecError(
                f"resources.total_cpus: {num_peers} peers cannot share {total} CPUs "
                "(every peer needs at least one)"
            )
    if any(index < 0 for index in spec.resources.gpus):
        raise SpecError("resources.gpus: GPU indices must be >= 0")


def _check_network(spec: ExperimentSpec) -> None:
    most = max(peer_counts(spec))
    seen: set[int] = set()
    for number, group in enumerate(spec.network.groups):
        for index in group.peers:
            if not 0 <= index < most:
                raise SpecError(
                    f"network.groups[{number}].peers: peer {index} does not exist "
                    f"(configurations have at most {most} peers, indices from 0)"
                )
            if index in seen:
                raise SpecError(f"network.groups[{number}].peers: peer {index} is in two groups")
            seen.add(index)
    fewest = min(peer_counts(spec))
    if all(spec.network.behind_nat(index) for index in range(fewest)):
        raise SpecError(
            f"network.groups: all {fewest} peers are behind NAT; at least one must be reachable "
            "(peers behind NAT run in client mode and need a reachable one to average with)"
        )


def _check_launcher(spec: ExperimentSpec) -> None:
    if spec.network.shaped and spec.launcher != "netns":
        raise SpecError(
            f"network: shaping links needs launcher = 'netns' (the {spec.launcher} launcher "
            "runs on an unshaped network); remove [network] or change the launcher"
        )
    if spec.launcher == "ssh" and not spec.ssh.hosts:
        raise SpecError("ssh.hosts: the ssh launcher needs an inventory ([[ssh.hosts]])")
    if spec.launcher != "ssh" and spec.ssh.hosts:
        raise SpecError(f"ssh: an inventory is given but launcher = '{spec.launcher}'")
    if spec.launcher != "ray" and "ray" in spec.model_fields_set:
        raise SpecError(f"ray: a [ray] table is given but launcher = '{spec.launcher}'")
    if spec.launcher == "ray" and spec.resources.gpus:
        raise SpecError("resources.gpus: the ray launcher places CPUs only (no GPUs yet)")


def _value_text(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return re.sub(r"[^A-Za-z0-9.,=-]", "", text).strip("-") or "none"


def _name(values: dict[str, Any], seed: int) -> str:
    parts = [f"{key}-{_value_text(value)}" for key, value in values.items()]
    return "_".join([*parts, f"seed-{seed}"]) if parts else f"swarm_seed-{seed}"


def expand(spec: ExperimentSpec) -> list[RunConfig]:
    """The sweep's configurations: baselines first (one per seed), then grid x seeds."""
    configs = []
    if spec.baseline:
        configs += [
            RunConfig(f"baseline_seed-{seed}", spec.train, seed, baseline=True)
            for seed in spec.seeds
        ]
    base = spec.train.model_dump()
    for combination in _grid_combinations(spec):
        train = TrainSpec.model_validate(base | combination)
        varying = {k: v for k, v in combination.items() if len(spec.grid[k]) > 1}
        configs += [
            RunConfig(_name(varying, seed), train, seed, False, combination) for seed in spec.seeds
        ]
    return configs


def cpu_split(total_cpus: int, num_peers: int) -> list[list[int]]:
    """CPU ids per peer: consecutive blocks summing to ``total_cpus`` (earlier peers take
    one more when it does not divide)."""
    size, extra = divmod(total_cpus, num_peers)
    blocks, start = [], 0
    for index in range(num_peers):
        count = size + (1 if index < extra else 0)
        blocks.append(list(range(start, start + count)))
        start += count
    return blocks
