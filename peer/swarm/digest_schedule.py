"""Which of a donor's epochs get a digest: each one while hashing is cheap next to an epoch, a
deterministic subset when it is not (up to ``StateSyncConfig.max_digest_stride``, ``peer join
--max-digest-stride``; 1 digests every epoch). The subset leaves replica checks fewer epochs to
agree on; a downloader asks its donors to digest their newest state at once
(:mod:`peer.swarm.state_fresh`), so newcomers still get the newest. Its gain is in
docs/BENCHMARKS.md.

Both digests of a snapshot (:mod:`peer.swarm.state_digest`) hash the state twice: about 10 ms of
CPU for the 8 MB state of ``peer bench train``'s model and Adam, whose epochs last about 90 ms
on two cores. Digested at every epoch, that was 14% of a core taken from training on a machine
whose cores all train, the largest part of what a lone peer lost to the plain loop.

So a donor digests the snapshot of epoch ``E`` at once only when ``E`` is a multiple of its
``stride``: the smallest power of two that keeps hashing within ``DIGEST_CPU_BUDGET`` of the
wall time, as long as two digested epochs stay at most ``MAX_DIGEST_GAP_S`` apart
(``StateSyncConfig.max_digest_gap_s``; a replica check lags by that much at most). The
stride is each peer's own (its costs, its epochs), but powers of two nest: the epochs a peer of
stride 8 digests include every epoch a peer of stride 16 digests, so peers agree on the coarser
grid, which is what a download's agreement and the replica check
(:mod:`peer.swarm.state_resync`) compare. With small states or slow epochs the stride is 1:
every epoch is digested, as before.

Always digested besides: a snapshot that does not follow the previous one by one epoch (the
first, a download, a re-sync: what this peer now vouches for) and, by the server, the newest
snapshot once the peer stayed at it for ``LINGER_S`` (a lone peer holding its epoch for a
newcomer, the end of a run), so that what it serves then is its current state.
"""

from __future__ import annotations

import collections
import statistics

# The share of the wall time that hashing snapshots may take (of one core).
DIGEST_CPU_BUDGET = 0.01
# The most time, in seconds of epochs, between two epochs a peer digests (unless one epoch
# takes longer, or the budget holds at a smaller stride). A replica check lags by this much at
# most; a newcomer does not (it asks its donors to digest their newest state). 4 s lets an
# 8-MB state's 230-ms epochs (the lone peer of peer bench train) reach the 1% budget's stride
# of 16; 1 s held them at 4.
MAX_DIGEST_GAP_S = 4.0
# The largest stride.
MAX_STRIDE = 64
# Epoch durations the stride is chosen from (their median).
NUM_EPOCH_TIMES = 16
# A newest snapshot that no newer one followed for this long is digested, in seconds.
LINGER_S = 0.5


def max_stride_problem(stride: int) -> str | None:
    """Why ``stride`` cannot be a donor's largest stride (None: it can)."""
    if 1 <= stride <= MAX_STRIDE and stride & (stride - 1) == 0:
        return None
    return f"must be a power of two in [1, {MAX_STRIDE}], got {stride}"


def choose_stride(
    *,
    cost_s: float,
    epoch_s: float,
    budget: float = DIGEST_CPU_BUDGET,
    max_gap_s: float = MAX_DIGEST_GAP_S,
) -> int:
    """The smallest power of two ``stride`` with ``cost_s <= budget * stride * epoch_s``, short
    of a stride whose epochs span more than ``max_gap_s`` (and of ``MAX_STRIDE``); 1 when
    either time is unknown (not positive)."""
    stride = 1
    if cost_s <= 0 or epoch_s <= 0:
        return stride
    while (
        stride < MAX_STRIDE
        and cost_s > budget * stride * epoch_s
        and 2 * stride * epoch_s <= max_gap_s
    ):
        stride *= 2
    return stride


class DigestSchedule:
    """Decides, snapshot by snapshot, whether a donor digests it at once (one per server; call
    from its event loop only)."""

    def __init__(
        self, *, max_stride: int = MAX_STRIDE, max_gap_s: float = MAX_DIGEST_GAP_S
    ) -> None:
        self.max_stride = max_stride
        self.max_gap_s = max_gap_s
        self.stride = 1
        self._cost_s = 0.0
        self._last: tuple[int, float] | None = None  # the previous snapshot's epoch and time
        self._epoch_times: collections.deque[float] = collections.deque(maxlen=NUM_EPOCH_TIMES)

    def wants(self, epoch: int, handed_s: float) -> bool:
        """Whether the snapshot of ``epoch``, handed over at ``handed_s`` (monotonic seconds),
        is digested at once; every snapshot is asked about once, in the order handed over."""
        follows = self._last is not None and epoch == self._last[0] + 1
        if follows:
            self._epoch_times.append(handed_s - self._last[1])
            self._restride()
        self._last = (epoch, handed_s)
        return not follows or epoch % self.stride == 0

    def measured(self, cost_s: float) -> None:
        """One snapshot's digests took ``cost_s`` seconds of CPU."""
        self._cost_s = cost_s
        self._restride()

    def _restride(self) -> None:
        epoch_s = statistics.median(self._epoch_times) if self._epoch_times else 0.0
        stride = choose_stride(cost_s=self._cost_s, epoch_s=epoch_s, max_gap_s=self.max_gap_s)
        self.stride = min(self.max_stride, stride)
