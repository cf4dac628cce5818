"""The settings of ``peer join``: one pydantic model, from flags, a TOML file and the environment.

Precedence: command-line flags > ``--config FILE`` (TOML) > environment (``VP_<FIELD>``) >
defaults (read by :mod:`peer.run.flags`). Every field is also a flag (``--field-name``), and
its description and default are what ``peer join --help`` prints, so this model is the one
place options are documented.
:class:`PeerConfig` composes the components' own configs (transport, DHT, progress, state sync,
trainer) from its fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from averaging.config import AveragerConfig
from dht.config import DHTConfig
from dht.errors import ConfigError
from dht.net.config import ReachabilityConfig, TransportConfig
from dht.options import NETWORK_OPTIONS as NET
from dht.options import peer_url, read_swarm_key
from peer.swarm.digest_schedule import MAX_DIGEST_GAP_S, MAX_STRIDE, max_stride_problem
from peer.swarm.progress import ProgressConfig
from peer.train.schedules import LRSchedule, make_lr_schedule

if TYPE_CHECKING:  # torch-importing modules: kept out of `peer dht` and `peer --help`
    from peer.profiling.profiler import ProfilerConfig
    from peer.swarm.newcomer_hold import NewcomerHoldConfig
    from peer.swarm.optimizer_config import CollaborativeConfig
    from peer.swarm.split_hold import SplitHoldConfig
    from peer.swarm.state_sync_config import StateSyncConfig
    from peer.train.trainer import TrainerConfig


class PeerConfig(BaseModel):
    """Everything a volunteer can set for ``peer join``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the run
    run_id: str = Field("vp-run", description="name of the training run; the DHT key prefix")
    task: str = Field(
        "synthetic", description="synthetic, charlm, images, or package.module:function"
    )
    task_option: list[str] = Field(
        default_factory=list, description="task option KEY=VALUE (repeatable)"
    )
    backend: Literal["native", "hivemind"] = Field("native", description="networking backend")
    # the network
    host: str = Field(NET["host"].default, description=NET["host"].help)
    port: int = Field(NET["port"].default, ge=0, le=65535, description=NET["port"].help)
    announce_host: str | None = Field(None, description=NET["announce_host"].help)
    source_host: str | None = Field(None, description=NET["source_host"].help)
    initial_peers: list[str] = Field(default_factory=list, description=NET["initial_peers"].help)
    client_mode: bool = Field(False, description="run no server (behind NAT); still contributes")
    identity: Path | None = Field(None, description=NET["identity"].help)
    swarm_key_file: Path | None = Field(None, description=NET["swarm_key_file"].help)
    relay: bool = Field(
        True, description="relay for peers others cannot reach (--no-relay: for no one)"
    )
    port_mapping: bool = Field(
        True,
        description="when nobody can dial this peer, ask the home router to forward its port "
        "(UPnP) before being relayed (--no-port-mapping: never)",
    )
    relay_via: list[str] = Field(
        default_factory=list,
        description="be reached through the first of these relays (URLs of reachable peers, "
        "repeatable) that accepts, and through the next when it dies: for a peer behind NAT; "
        "it averages as a client",
    )
    max_relayed_bytes_per_s: float = Field(
        NET["max_relayed_bytes_per_s"].default,
        gt=0,
        description=NET["max_relayed_bytes_per_s"].help,
    )
    # training
    target_batch_size: int = Field(2048, gt=0, description="samples the swarm gathers per epoch")
    lr: float = Field(1e-3, gt=0, description="learning rate of the optimizer")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="local optimizer")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR over the swarm's epochs, after the warmup"
    )
    warmup_epochs: int = Field(0, ge=0, description="epochs of linear LR warmup")
    schedule_epochs: int | None = Field(
        None, gt=0, description="epoch where linear/cosine decay ends (default: --max-epochs)"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final LR / --lr of the decay")
    mode: Literal["grad", "params", "diloco"] = Field("grad", description="what is averaged")
    delay_update: bool = Field(
        False, description="overlap each round with the next epoch's compute (grad mode)"
    )
    diloco_overlap: bool = Field(
        False,
        description="diloco mode: run each outer round in the background while the next inner "
        "steps go on; its outer step lands one round late, the inner progress made meanwhile kept",
    )
    min_round_interval: float = Field(
        0.05,
        ge=0,
        description="seconds from the end of one round to the start of the next with others, at "
        "least; a target the swarm reaches sooner is gathered on (keeps rounds' requests within "
        "each peer's share)",
    )
    max_epochs: int | None = Field(None, gt=0, description="stop after this many epochs")
    max_steps: int | None = Field(None, gt=0, description="stop after this many local steps")
    max_time: float | None = Field(None, gt=0, description="stop after this many seconds")
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda, cuda:N")
    amp: Literal["auto", "bf16", "fp16", "off"] = Field("auto", description="mixed precision")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes")
    torch_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads (several peers on one machine: cores/peers)"
    )
    max_grad_norm: float | None = Field(None, gt=0, description="clip gradients to this L2 norm")
    seed: int | None = Field(None, description="seed of this peer's data (default: from its id)")
    # averaging
    compression: Literal["none", "fp16", "uint8"] = Field("none", description="wire format")
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = Field(
        "mean",
        description="how reducers combine contributions: the weighted mean, or a rule robust to "
        "a minority of poisoned gradients (grad mode; every peer of a run must use the same)",
    )
    target_group_size: int = Field(16, ge=1, description="peers per averaging group")
    min_group_size: int = Field(2, ge=1, description="fewer peers than this is no group")
    matchmaking_time: float = Field(
        5.0,
        gt=0,
        description="most seconds to look for a group (less once arrivals are measured)",
    )
    averaging_timeout: float = Field(30.0, gt=0, description="seconds for one whole round")
    min_deadline: float = Field(
        1.0,
        gt=0,
        le=60,
        description="shortest adaptive network wait in seconds (a stall on a busy host, or a "
        "paused swarm, shorter than this never looks like a dead peer)",
    )
    newcomer_wait: float = Field(
        10.0, ge=0, description="seconds a peer alone at its epoch holds it for a peer catching up"
    )
    split_wait: float = Field(
        60.0,
        ge=0,
        description="seconds a peer two or more epochs ahead of most of the swarm holds its "
        "epoch for them to arrive, so that the replicas meet at one epoch (0: never)",
    )
    state_compression: Literal["none", "bf16"] = Field(
        "none", description="state downloads: float32 tensors as bfloat16 (half the bytes)"
    )
    max_digest_stride: int = Field(
        MAX_STRIDE,
        description="when hashing the served state is costly next to an epoch, digest only "
        "epochs that are multiples of a power of two up to this (1: every epoch)",
    )
    max_digest_gap: float = Field(
        MAX_DIGEST_GAP_S,
        gt=0,
        description="with --max-digest-stride: most seconds between digested epochs",
    )
    # outputs
    checkpoint_dir: Path | None = Field(None, description="periodic atomic checkpoints; resume")
    checkpoint_interval: float = Field(60.0, gt=0, description="seconds between checkpoints")
    metrics_file: Path | None = Field(None, description="JSON Lines metrics stream")
    metrics_interval: float = Field(5.0, gt=0, description="seconds between metrics lines")
    dashboard: bool = Field(
        False, description="show this peer and its swarm live in the terminal (q quits)"
    )
    trace: Path | None = Field(None, description="Chrome/Perfetto trace of phases (Perfetto UI)")
    trace_max_mb: float = Field(
        64.0, gt=0, description="phase slices in --trace stop at this size (MiB); epochs go on"
    )
    profile_interval: float = Field(
        5.0, gt=0, description="seconds between profile summaries (logged verdict, DHT record)"
    )
    profile_window: float = Field(
        30.0, gt=0, description="seconds the rolling profile summary covers"
    )
    steady_allocator: bool = Field(
        True,
        description="fixed glibc malloc thresholds: freed tensor memory (up to 64 MiB) stays "
        "in the heap instead of being unmapped and faulted back every step",
    )
    profile_sync: bool = Field(
        False, description="wait for the GPU at each phase boundary (exact, loses overlap)"
    )
    publish_interval: float = Field(
        2.0,
        gt=0,
        description="seconds between progress records (the estimate extrapolates between them)",
    )
    wait_for_peers: int = Field(
        1, ge=1, description="before training, wait until this many peers (self included) are up"
    )
    wait_for_peers_timeout: float = Field(
        120.0, gt=0, description="seconds to wait for --wait-for-peers, then train anyway"
    )

    @model_validator(mode="after")
    def _across_fields(self) -> PeerConfig:
        self.lr_schedule_fn()  # raises ConfigError naming the option
        if self.delay_update and self.mode != "grad":
            raise ConfigError(f"--delay-update needs --mode grad, not {self.mode}")
        if self.diloco_overlap and self.mode != "diloco":
            raise ConfigError(f"--diloco-overlap needs --mode diloco, not {self.mode}")
        if self.relay_via and (self.client_mode or self.backend != "native"):
            raise ConfigError("--relay-via needs the native backend and no --client-mode")
        return self

    def lr_schedule_fn(self) -> LRSchedule | None:
        """The LR factor per epoch, or None for a constant LR."""
        return make_lr_schedule(
            self.lr_schedule,
            warmup_epochs=self.warmup_epochs,
            total_epochs=self.schedule_epochs or self.max_epochs,
            min_lr_ratio=self.min_lr_ratio,
        )

    @field_validator("initial_peers")
    @classmethod
    def _urls(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        if info.data.get("backend") == "hivemind":
            return urls  # libp2p multiaddrs (/ip4/.../p2p/...); the hivemind backend checks them
        return [peer_url(url) for url in urls]

    @field_validator("relay_via")
    @classmethod
    def _relay_urls(cls, urls: list[str]) -> list[str]:
        return [peer_url(url) for url in urls]

    @field_validator("max_digest_stride")
    @classmethod
    def _stride(cls, stride: int) -> int:
        problem = max_stride_problem(stride)
        if problem is not None:
            raise ValueError(problem)
        return stride

    @field_validator("task_option")
    @classmethod
    def _options(cls, options: list[str]) -> list[str]:
        for option in options:
            if "=" not in option:
                raise ValueError(f"{option!r} is not KEY=VALUE")
        return options

    def task_options(self) -> dict[str, str]:
        return dict(option.split("=", 1) for option in self.task_option)

    # ---- composition -------------------------------------------------------------------------

    def swarm_key(self) -> bytes | None:
        return read_swarm_key(self.swarm_key_file)

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            host=self.host,
            port=self.port,
            announce_host=self.announce_host,
            source_host=self.source_host,
            client_mode=self.client_mode,
            swarm_key=self.swarm_key(),
            relay_enabled=self.relay,
            max_relayed_bytes_per_s=self.max_relayed_bytes_per_s,
            reachability=ReachabilityConfig(try_port_mapping=self.port_mapping),
        )

    def dht_config(self) -> DHTConfig:
        return DHTConfig(initial_peers=tuple(self.initial_peers))

    def progress_config(self) -> ProgressConfig:
        return ProgressConfig(
            target_batch_size=self.target_batch_size,
            publish_interval_s=self.publish_interval,
            record_ttl_s=max(10 * self.publish_interval, 20.0),
        )

    def state_sync_config(self) -> StateSyncConfig:
        from peer.swarm.state_sync_config import StateSyncConfig

        return StateSyncConfig(
            compression=self.state_compression,
            max_digest_stride=self.max_digest_stride,
            max_digest_gap_s=self.max_digest_gap,
        )

    def averager_config(self) -> AveragerConfig:
        return AveragerConfig(
            target_group_size=self.target_group_size,
            min_group_size=min(self.min_group_size, self.target_group_size),
            matchmaking_time_s=self.matchmaking_time,
            allreduce_timeout_s=self.averaging_timeout,
            compression=self.compression,
            aggregation=self.aggregation,
            min_deadline_s=self.min_deadline,
        )

    def newcomer_hold_config(self) -> NewcomerHoldConfig:
        from peer.swarm.newcomer_hold import NewcomerHoldConfig

        # a peer behind may spend a whole matchmaking wait in a round that reports nothing
        return NewcomerHoldConfig(wait_s=self.newcomer_wait, round_s=self.matchmaking_time)

    def split_hold_config(self) -> SplitHoldConfig:
        from peer.swarm.split_hold import SplitHoldConfig

        return SplitHoldConfig(wait_s=self.split_wait)

    def collaborative_config(self) -> CollaborativeConfig:
        from peer.swarm.optimizer_config import CollaborativeConfig

        return CollaborativeConfig(
            mode=self.mode,
            delay_update=self.delay_update,
            diloco_overlap=self.diloco_overlap,
            target_batch_size=self.target_batch_size,
            averaging_timeout_s=self.matchmaking_time + self.averaging_timeout,
            min_round_interval_s=self.min_round_interval,
        )

    def trainer_config(self) -> TrainerConfig:
        from peer.train.trainer import TrainerConfig

        return TrainerConfig(
            device=self.device,
            amp=self.amp,
            num_workers=self.num_workers,
            max_grad_norm=self.max_grad_norm,
        )

    def profiler_config(self) -> ProfilerConfig:
        from peer.profiling.profiler import ProfilerConfig

        return ProfilerConfig(
            interval_s=self.profile_interval,
            window_s=max(self.profile_window, self.profile_interval),
            trace_path=self.trace,
            trace_max_bytes=max(int(self.trace_max_mb * 2**20), 1024),
            synchronize_device=self.device if self.profile_sync else None,
            backend=self.backend,
        )
