"""The experiment file's format: one strict pydantic model per TOML table.

Every model refuses unknown keys and is frozen; :mod:`experiments.spec` reads a file into
:class:`ExperimentSpec` and checks what spans tables (the grid, the CPUs, the network, the
launcher).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
