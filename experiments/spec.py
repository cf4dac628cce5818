"""The experiment file (TOML): what to run, on what resources and network, until when.

:func:`load_spec` reads and checks a file up front; every mistake is one :class:`SpecError` line
naming the key (``grid.peers: ...``), before anything starts. :func:`expand` turns a spec into
the configurations of the sweep: the grid's cross product times the seeds, plus one single-node
baseline per seed. See ``docs/EXPERIMENTS.md`` for the format and ``experiments/presets/``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class SpecError(ValueError):
    """The experiment file is invalid; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Strict):
    """``[task]``: the task every peer and the baseline train."""

    name: str = Field("synthetic", description="synthetic, charlm, or package.module:function")
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="task options, passed as --task-option KEY=VALUE"
    )


class TrainSpec(_Strict):
    """``[train]``: one configuration's settings; ``[grid]`` sweeps any of them."""

    peers: int = Field(2, ge=1, description="peer processes")
    batch_size: int | None = Field(None, ge=1, description="samples per local step")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    target_batch_size: int = Field(2048, ge=1, description="samples per swarm epoch")
    mode: Literal["grad", "params", "diloco"] = "grad"
    compression: Literal["none", "fp16", "uint8"] = "none"
    backend: Literal["native", "hivemind"] = "native"
    optimizer: Literal["adam", "sgd"] = "adam"
    delay_update: bool = False
    matchmaking_time_s: float | None = Field(None, gt=0, description="--matchmaking-time")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per peer")
    join_args: list[str] = Field(default_factory=list, description="extra `peer join` flags")


GRID_KEYS = tuple(TrainSpec.model_fields)


class LinkSpec(_Strict):
    """One peer's link to the emulated network (both directions shaped alike)."""

    bandwidth_mbit: float | None = Field(None, gt=0, description="rate limit, Mbit/s")
    latency_ms: float = Field(0.0, ge=0, description="one-way added delay, ms")
    jitter_ms: float = Field(0.0, ge=0, description="delay variation, ms")
    loss_percent: float = Field(0.0, ge=0, le=100, description="packets dropped, %")

    @property
    def shaped(self) -> bool:
        return self.bandwidth_mbit is not None or self.needs_netem

    @property
    def needs_netem(self) -> bool:
        return self.latency_ms > 0 or self.jitter_ms > 0 or self.loss_percent > 0


class NetworkGroup(LinkSpec):
    """``[[network.groups]]``: a link for the peers with these indices; every link field it
    does not set is ``[network]``'s (``nat = true`` alone keeps the swarm's shaping)."""

    peers: list[int] = Field(min_length=1, description="peer indices (0-based)")
    nat: bool = Field(
        False, description="each of these peers behind its own masquerading home router"
    )


class NetworkSpec(LinkSpec):
    """``[network]``: every peer's link, with ``groups`` overriding it for some peers."""

    groups: list[NetworkGroup] = Field(default_factory=list)
    emulator: Literal["auto", "tc", "linkemu"] = Field(
        "auto",
        description="tc: kernel qdiscs (netem for latency, jitter and loss); linkemu: the "
        "user-space emulator; auto: tc unless the kernel lacks sch_netem and netem is needed",
    )
    tcp_congestion: str | None = Field(
        None,
        pattern=r"^[a-z0-9_]{1,16}$",
        description="TCP congestion control in every peer's namespace, e.g. cubic (the "
        "default of Linux distributions, Windows and macOS) or bbr; None: the host's default",
    )

    def link_for(self, index: int) -> LinkSpec:
        """Peer ``index``'s link: its group's, or ``[network]``'s."""
        for group in self.groups:
            if index in group.peers:
                return self.group_link(group)
        return LinkSpec(**self.model_dump(include=set(LinkSpec.model_fields)))

    def group_link(self, group: NetworkGroup) -> LinkSpec:
        """``group``'s link: the fields it sets over ``[network]``'s."""
        link_fields = set(LinkSpec.model_fields)
        inherited = self.model_dump(include=link_fields)
        own = group.model_dump(include=group.model_fields_set & link_fields)
        return LinkSpec(**inherited | own)

    def behind_nat(self, index: int) -> bool:
        """Whether peer ``index`` sits behind a NAT router."""
        return any(group.nat and index in group.peers for group in self.groups)

    @property
    def shaped(self) -> bool:
        return super().shaped or any(self.group_link(g).shaped or g.nat for g in self.groups)

    @property
    def needs_netem(self) -> bool:
        return super().needs_netem or any(self.group_link(g).needs_netem for g in self.groups)


class ResourcesSpec(_Strict):
    """``[resources]``: CPUs split across a configuration's peers; the baseline gets them all."""

    total_cpus: int = Field(
        default_factory=lambda: os.cpu_count() or 1, ge=1, description="CPUs per configuration"
    )
    pin_cpus: bool = Field(True, description="pin each peer to its CPUs (CPU affinity)")
    gpus: list[int] = Field(default_factory=list, description="GPU indices, round robin")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment of every peer and the baseline, e.g. OMP_WAIT_POLICY",
    )


class StopSpec(_Strict):
    """``[stop]``: when a configuration ends (the first rule that fires)."""

    max_time_s: float | None = Field(None, gt=0, description="training seconds")
    max_epochs: int | None = Field(None, ge=1, description="swarm epochs (optimizer steps)")
    target_loss: float | None = Field(None, description="stop once the swarm's loss is below")
    timeout_s: float = Field(600.0, gt=0, description="bound on a configuration, start included")

    @model_validator(mode="after")
    def _some_rule(self) -> StopSpec:
        if self.max_time_s is None and self.max_epochs is None:
            raise ValueError("give max_time_s or max_epochs (target_loss alone may never stop)")
        return self


class HostSpec(_Strict):
    """One machine of the ssh inventory."""

    host: str = Field(min_length=1, description="address others reach it on")
    user: str | None = None
    port: int = Field(22, ge=1, le=65535)
    key: Path | None = Field(None, description="private key file")
    python: str = Field("python3", description="python with volunteer-peer installed (venv)")
    workdir: str = Field("volunteer-peer-runs", description="remote directory for runs")
    listen_host: str = Field("0.0.0.0", description="interface peers listen on")
    ssh_options: list[str] = Field(default_factory=list, description="extra -o options")

    @field_validator("key")
    @classmethod
    def _home(cls, key: Path | None) -> Path | None:
        return None if key is None else key.expanduser()


class SshSpec(_Strict):
    """``[ssh]``: the inventory, inline (``[[ssh.hosts]]``) or in a TOML file."""

    hosts: list[HostSpec] = Field(default_factory=list)
    inventory: Path | None = Field(None, description="TOML file with [[hosts]]")
    connect_timeout_s: float = Field(10.0, gt=0)


class RaySpec(_Strict):
    """``[ray]``: the Ray cluster the ``ray`` launcher runs a sweep on."""

    address: str = Field(
        "auto",
        description='"auto" (the cluster this machine is a node of, or $RAY_ADDRESS), '
        '"HOST:PORT" (the head\'s GCS port, 6379) or "ray://HOST:10001" (Ray Client)',
    )
    placement: Literal["spread", "pack"] = Field(
        "spread",
        description="spread: one peer per node where the cluster has the nodes (else as few "
        "on a node as Ray can); pack: as few nodes as hold the peers",
    )
    ready_timeout_s: float = Field(
        120.0, gt=0, description="seconds a configuration may wait for its CPUs on the cluster"
    )
    listen_host: str = Field(
        "0.0.0.0",
        min_length=1,
        description="interface peers listen on (they announce their node's address)",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, address: str) -> str:
        match = re.fullmatch(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})", address)
        if address != "auto" and (match is None or not 0 < int(match[3]) < 65536):
            raise ValueError(f'{address!r}: give "auto", "HOST:PORT" or "ray://HOST:10001"')
        return address


class CalibrationSpec(_Strict):
    """``[calibration]``: before the sweep, find the fastest setting of the baseline for all
    the CPUs and of a peer for its share (see :mod:`experiments.calibration`)."""

    enabled: bool = Field(False, description="calibrate before the sweep")
    measure_s: float = Field(6.0, gt=0, description="seconds each setting trains, measured")
    warmup_s: float = Field(2.0, ge=0, description="seconds each setting trains first, unmeasured")
    wait_policies: list[Literal["PASSIVE", "ACTIVE"]] = Field(
        default_factory=lambda: ["PASSIVE", "ACTIVE"], min_length=1, description="OMP_WAIT_POLICY"
    )
    baseline_num_workers: list[int] = Field(
        default_factory=lambda: [0], min_length=1, description="loader workers the baseline tries"
    )
    repeats: int = Field(1, ge=1, description="rounds over the settings (median; alternate order)")
    probe_timeout_s: float = Field(120.0, gt=0, description="bound on one setting's process")


class ExperimentSpec(_Strict):
    """The whole experiment file."""

    name: str = Field("experiment", min_length=1)
    launcher: Literal["local", "netns", "ssh", "ray"] = "local"
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    baseline: bool = Field(True, description="also run the single-node baseline")
    metrics_interval_s: float = Field(2.0, gt=0, description="seconds between metrics lines")
    task: TaskSpec = Field(default_factory=TaskSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    stop: StopSpec
    ssh: SshSpec = Field(default_factory=SshSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)


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
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML: {e}") from None
    return parse_spec(data, base_dir=path.parent)


def _with_inventory(spec: ExperimentSpec, base_dir: Path) -> ExperimentSpec:
    path = spec.ssh.inventory if spec.ssh.inventory.is_absolute() else base_dir / spec.ssh.inventory
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"ssh.inventory: cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"ssh.inventory: {path} is not valid TOML: {e}") from None
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
