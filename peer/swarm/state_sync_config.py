"""How state is served and fetched: :class:`StateSyncConfig`, the settings of the state server
(:mod:`peer.swarm.state_sync`), the downloader (:mod:`peer.swarm.state_download`) and the
replica re-sync (:mod:`peer.swarm.state_resync`), checked as they are made.

Compression (the downloader's choice, ``StateSyncConfig.compression``): ``bf16`` sends every
float32 tensor as bfloat16, half the bytes. bfloat16 keeps float32's exponent range, so nothing
overflows or flushes to zero (optimizer moments stay usable), and each value is rounded to 8
significant bits: ``|x - x'| <= |x| * 2**-8``. In ``grad`` mode the peers never average
parameters, so a newcomer keeps that rounding offset; ``params`` and ``diloco`` average it away at
the next round. The conversions run off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from dht.errors import ConfigError
from peer.swarm.digest_schedule import MAX_DIGEST_GAP_S, MAX_STRIDE, max_stride_problem
from peer.swarm.state_serve import COMPRESSIONS, MAX_PARTS


@dataclass(frozen=True, kw_only=True)
class StateSyncConfig:
    """How state is served and fetched.

    Attributes:
        announce_interval_s: how often a donor re-announces itself, in seconds.
        record_ttl_s: how long a donor's announcement lives, in seconds.
        chunk_bytes: bytes per stream chunk.
        download_timeout_s: bound on one whole download from one donor, in seconds.
        max_attempts: donors tried before giving up.
        backoff_s: wait before the second attempt; doubles for each further one, in seconds.
        min_agreement: a downloaded state's digest must be announced by this many distinct
            peers at its epoch (fewer when fewer peers announce at all).
        compression: how a downloader asks for float32 tensors: ``none`` (exact) or ``bf16``
            (half the bytes; see the module docstring).
        max_streams: state streams a donor serves at once, in all.
        max_streams_per_peer: of those, at most this many per proven peer id.
        max_streams_per_address: and this many per source address (an IPv6 /64 is one).
        max_split_donors: a download asks up to this many donors that serve the same agreed
            state for one part of it each (:mod:`peer.swarm.state_split`); 1 never splits.
        max_old_snapshots: snapshots the donor has moved past that its streams may still keep
            in memory; the streams of older ones are cut (:mod:`peer.swarm.state_serve`).
        serve_timeout_s: the longest a donor serves one stream, in seconds.
        resync_min_epochs: a replica that differs from the agreed one is re-synced at most once
            per this many epochs, twice as many after each re-sync that did not bring it in
            line (:mod:`peer.swarm.state_resync`).
        resync_max_epochs: the most epochs between two re-syncs.
        resync_check_s: how often a peer looks whether its replica differs, in seconds (one
            read of the announcements per epoch at most).
        max_digest_stride: when hashing is costly next to an epoch, a donor digests only
            epochs that are multiples of a power of two up to this
            (:mod:`peer.swarm.digest_schedule`): less CPU, but replica checks see fewer epochs
            to agree on (a downloader asks its donors to digest their newest state at once:
            :mod:`peer.swarm.state_fresh`). 1 digests every epoch. A power of two.
        max_digest_gap_s: with a stride, the most seconds of epochs between two digested
            epochs (a replica check lags by that much at most).
        request_timeout_s: bound on a request to a donor to digest its newest state now, in
            seconds.
    """

    announce_interval_s: float = 5.0
    record_ttl_s: float = 30.0
    chunk_bytes: int = 4 * 1024 * 1024
    download_timeout_s: float = 120.0
    max_attempts: int = 4
    backoff_s: float = 0.5
    min_agreement: int = 2
    compression: str = "none"
    max_streams: int = 16
    max_streams_per_peer: int = 2
    max_streams_per_address: int = 4
    max_old_snapshots: int = 2
    serve_timeout_s: float = 600.0
    max_split_donors: int = 3
    resync_min_epochs: int = 2
    resync_max_epochs: int = 64
    resync_check_s: float = 1.0
    max_digest_stride: int = MAX_STRIDE
    max_digest_gap_s: float = MAX_DIGEST_GAP_S
    request_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"compression must be one of {COMPRESSIONS}, got {self.compression!r}"
            )
        for name in (
            "announce_interval_s",
            "record_ttl_s",
            "download_timeout_s",
            "backoff_s",
            "serve_timeout_s",
            "resync_check_s",
            "max_digest_gap_s",
            "request_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_streams",
            "max_split_donors",
            "max_streams_per_peer",
            "max_streams_per_address",
            "resync_min_epochs",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_split_donors > MAX_PARTS:
            raise ConfigError(f"max_split_donors must be <= {MAX_PARTS}")
        if self.max_old_snapshots < 0:
            raise ConfigError(f"max_old_snapshots must be >= 0, got {self.max_old_snapshots}")
        if self.resync_max_epochs < self.resync_min_epochs:
            raise ConfigError("resync_max_epochs must be >= resync_min_epochs")
        if self.chunk_bytes < 1024:
            raise ConfigError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.min_agreement < 1:
            raise ConfigError(f"min_agreement must be >= 1, got {self.min_agreement}")
        problem = max_stride_problem(self.max_digest_stride)
        if problem is not None:
            raise ConfigError(f"max_digest_stride {problem}")
