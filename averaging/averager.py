"""DecentralizedAverager: find a group, average the tensors with it in place, report the round.

Usage (build it before the transport starts: it adds its handlers to the transport)::

    transport = HttpTransport(identity, TransportConfig())
    node = DHTNode(transport=transport, identity=identity, config=DHTConfig(...))
    averager = DecentralizedAverager(
        [p.grad for p in model.parameters()], transport=transport, dht=node, prefix="run1.grads"
    )
    async with transport, node, averager:
        result = await averager.step(weight=num_samples, epoch=epoch)
        if not result.averaged:
            ...  # alone or failed: step locally

A client-mode peer (a transport without an address) sends and receives but reduces no part. A
training loop in another thread calls :meth:`DecentralizedAverager.step_blocking`.

The averager checks a step, finds its group and keeps what a round leaves behind (partners, the
key layout, the count of rounds); the values' way through the round (gather, all-reduce, second
level, scatter) is :class:`averaging.group_rounds.GroupRounds`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from averaging.allreduce.deadlines import Deadlines
from averaging.allreduce.streams import StreamChooser
from averaging.bounds import valid_weight
from averaging.config import AveragerConfig, check_prefix, reducing_address
from averaging.errors import AveragingError, ConfigError, translate
from averaging.group_rounds import GroupRounds
from averaging.levels import SecondLevel, TopRound
from averaging.matchmaking.group import GroupInfo
from averaging.matchmaking.matchmaker import Matchmaker, MatchmakingDHT
from averaging.matchmaking.search import MatchResult, SearchOptions
from averaging.result import RoundResult
from averaging.rounds import LayoutMemory, round_plan, row_search
from averaging.rules.compression import Compression
from averaging.spread import Spreads
from averaging.tensors import FlatTensors
from dht.errors import DHTError
from dht.runtime import EventLoopThread

logger = logging.getLogger(__name__)

_FACADE_SLACK_S = 5.0  # the blocking facade's bound beyond the step's own
_RTT_WINDOW_S = 120.0  # RTTs measured this recently count toward the deadlines
_RTT_REFRESH_S = 1.0  # the median RTT is computed again at most this often


class DecentralizedAverager:
    """Averages a set of tensors with other peers, one round per :meth:`step`.

    Args:
        tensors: the tensors to average in place (torch tensors or numpy arrays; every peer of
            the run passes tensors of the same total size).
        transport: the network, not yet started (the averager adds its handlers to it).
        dht: where groups are found; None for an averager that only runs given groups
            (:meth:`step_in_group`).
        prefix: this averager's name in the run (e.g. "run1.grads"); peers average with peers
            of the same prefix.
        config: group sizes, timeouts, chunking and compression.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        *,
        transport,
        dht: MatchmakingDHT | None,
        prefix: str,
        config: AveragerConfig | None = None,
    ):
        self.prefix = check_prefix(prefix)
        self.config = config or AveragerConfig()
        self.peer_id: str = transport.peer_id
        self._transport = transport
        self._tensors = FlatTensors(tensors)
        self._rtt_cache: tuple[float, float | None] = (-math.inf, None)  # (when, median)
        self.deadlines = Deadlines(self.config, self._measured_rtt_s)
        self.streams = StreamChooser(self.config, self._measured_rtt_s)
        self._group_rounds = GroupRounds(
            self._tensors,
            transport=transport,
            stream_name=f"averaging.{prefix}.part",
            peer_id=self.peer_id,
            config=self.config,
            deadlines=self.deadlines,
            streams=self.streams,
        )
        self._matchmaker = None
        self._second: SecondLevel | None = None
        if dht is not None:
            self._matchmaker = Matchmaker(
                transport=transport,
                dht=dht,
                peer_id=self.peer_id,
                prefix=prefix,
                config=self.config,
                deadlines=self.deadlines,
                num_streams=self.streams.choose,
            )
            self._second = SecondLevel(
                self.peer_id,
                Spreads(transport, prefix, self.config),
                self._find_top,
                self._group_rounds.allreduce,
                self.config,
            )
        self._compression = self.config.compression  # of the step in progress
        self._epoch: int | None = None  # of the step in progress
        self._search_key = ""  # of the step in progress
        self._layout = LayoutMemory()
        self._lock = asyncio.Lock()
        self._closed = False
        self.num_rounds = 0

    @property
    def tensors(self) -> tuple[Any, ...]:
        """The tensors averaged in place, as given."""
        return tuple(self._tensors.tensors)

    @property
    def numel(self) -> int:
        """Values averaged per round."""
        return self._tensors.numel

    @property
    def client_mode(self) -> bool:
        return reducing_address(self._transport, self.config) is None

    async def __aenter__(self) -> DecentralizedAverager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Refuse further steps and wait for a step in progress to end; safe twice."""
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            pass

    def matchmaking_key(self, epoch: int | None) -> str:
        """The DHT key under which peers of this round find each other."""
        key = f"{self.prefix}.mm"
        if epoch is not None:
            key += f".{epoch}"
        if self.config.group_bits:
            key += f".{self.config.group_bits}"
        return key

    async def step(
        self,
        weight: float = 1.0,
        *,
        epoch: int | None = None,
        timeout_s: float | None = None,
        compression: Compression | str | None = None,
        target_group_size: int | None = None,
        expected_peers: int | None = None,
        stop_when: Callable[[], str | None] | None = None,
    ) -> RoundResult:
        """Find a group and average the tensors with it, in place.

        Args:
            weight: this peer's weight (e.g. samples since the last round); 0 takes part
                without contributing.
            epoch: peers average only with peers of the same epoch (None: any).
            timeout_s: bound on the whole step in seconds (default: matchmaking_time_s +
                allreduce_timeout_s, plus top_round_timeout_s + allreduce_timeout_s when the
                round takes two levels).
            compression: the wire format if this peer leads the group (default: the config's).
            target_group_size: the largest group (default: the config's). Without
                ``expected_peers``, a leader closes its group as soon as it has this many.
            expected_peers: how many peers are ready for this round, this one included (None:
                unknown). Groups are then balanced rows (:mod:`averaging.matchmaking.rows`),
                and when they cannot all fit in one group the rows' means are averaged at a
                second level so that every row ends with the global mean
                (:mod:`averaging.levels`; the weighted mean only).
            stop_when: asked on the event loop between the search's reads of the DHT while
                this peer is in no group in the making (:class:`SearchOptions`); a reason ends
                the search at once with an "alone" result giving that reason. For a caller
                that learns nobody will come (its epoch's peers moved on) before the
                matchmaking time is out. Cheap and non-blocking.

        Returns:
            The round's result; "alone" when no group formed (the tensors are untouched).

        Raises:
            ConfigError: a bad weight, timeout, compression or expected_peers.
            AveragingError: the averager is closed or has no DHT.
        """
        layout_peers = self._layout.layout_peers(epoch, expected_peers)
        plan = round_plan(self.config, expected_peers, target_group_size, layout_peers)
        if timeout_s is None and plan is not None and not plan.single:
            timeout_s = self._default_timeout_s(two_levels=True)
        weight, timeout_s = self._check_step(weight, timeout_s)
        try:
            compression = Compression(compression or self.config.compression)
        except ValueError:
            raise ConfigError(
                f"compression must be none, fp16 or uint8, got {compression!r}"
            ) from None
        if self._matchmaker is None:
            raise AveragingError("this averager has no DHT: use step_in_group")
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            phase_s: dict[str, float] = {}
            weight = await self._group_rounds.gather(weight, compression, phase_s)
            self._compression, self._epoch = compression, epoch
            base = self.matchmaking_key(epoch)
            seed = self.matchmaking_key(None)
            key, options = row_search(self.config, self.peer_id, base, plan, seed)
            self._search_key = key
            if stop_when is not None:
                options = dataclasses.replace(options or SearchOptions(), stop_when=stop_when)
            waits = self.deadlines.snapshot()
            start = loop.time()
            rows_s = min(waits["matchmaking_s"], timeout_s)
            match = await self._matchmaker.find_group(
                key,
                weight=weight,
                numel=self.numel,
                compression=compression,
                timeout_s=rows_s,
                target_group_size=target_group_size,
                options=options,
            )
            phase_s["matchmaking"] = loop.time() - start
            # the latest any row search of this round gives up (the waits adapt per peer)
            rows_end = start + min(self.config.matchmaking_time_s, timeout_s)
            top = TopRound(f"{base}.top", plan, rows_end)
            if match.group is None and not match.stopped and options and options.top_rows:
                solo = await self._group_rounds.solo(
                    self._second, weight, top, options.top_rows, deadline
                )
                if solo.status != "alone":
                    return await self._end(key, solo, phase_s, waits)
                # say why at both levels: the row search's reason alone hid a missed top round
                match = dataclasses.replace(match, reason=f"{match.reason}; {solo.reason}")
            if match.group is None:
                result = RoundResult("alone", match.reason, phase_s=phase_s, deadlines_s=waits)
                return self._finish(key, result, phase_s["matchmaking"])
            remaining_s = max(0.001, deadline - loop.time())
            return await self._average(key, match.group, phase_s, remaining_s, waits, top=top)

    async def step_in_group(
        self, group: GroupInfo, *, timeout_s: float | None = None
    ) -> RoundResult:
        """Average with a group formed by other means (this peer's weight is its entry there)."""
        _, timeout_s = self._check_step(0.0, timeout_s)
        if self.peer_id not in group.peer_ids:
            raise ConfigError("this peer is not a member of the group")
        own_weight = group.member(self.peer_id).weight
        async with self._lock:
            phase_s: dict[str, float] = {}
            weight = await self._group_rounds.gather(own_weight, group.compression, phase_s)
            if weight != own_weight:
                raise AveragingError("local tensors are not finite: cannot join a fixed group")
            phase_s["matchmaking"] = 0.0
            waits = self.deadlines.snapshot()
            self._epoch, self._search_key = None, ""
            return await self._average(group.group_id, group, phase_s, timeout_s, waits)

    def step_blocking(
        self,
        runner: EventLoopThread,
        weight: float = 1.0,
        *,
        epoch: int | None = None,
        timeout_s: float | None = None,
        compression: Compression | str | None = None,
        target_group_size: int | None = None,
        expected_peers: int | None = None,
        stop_when: Callable[[], str | None] | None = None,
    ) -> RoundResult:
        """:meth:`step` from a thread outside the event loop (the training loop's facade).

        Args:
            runner: the event-loop thread this averager's transport runs on.
            weight, epoch, timeout_s, compression, target_group_size, expected_peers,
                stop_when: as for :meth:`step`.

        Raises:
            PeerTimeoutError: the step did not end within its own bound plus a few seconds.
        """
        plan = round_plan(self.config, expected_peers, target_group_size)
        two_levels = plan is not None and not plan.single
        bound_s = (timeout_s or self._default_timeout_s(two_levels)) + _FACADE_SLACK_S
        step = self.step(
            weight,
            epoch=epoch,
            timeout_s=timeout_s,
            compression=compression,
            target_group_size=target_group_size,
            expected_peers=expected_peers,
            stop_when=stop_when,
        )
        try:
            return runner.run(step, timeout_s=bound_s)
        except DHTError as e:
            raise translate(e) from e

    # ---- internals ---------------------------------------------------------------------------

    def _measured_rtt_s(self) -> float | None:
        """The transport's median RTT to the peers it asked lately (None: none measured),
        computed at most once per ``_RTT_REFRESH_S``: every deadline of every chunk asks for
        it, and the median over the last few thousand samples was 3% of a 64-peer bench
        process's CPU."""
        now_s = time.monotonic()
        computed_s, rtt_s = self._rtt_cache
        if rtt_s is not None and now_s - computed_s < _RTT_REFRESH_S:
            return rtt_s
        counters = getattr(self._transport, "counters", None)
        median_rtt_s = getattr(counters, "median_rtt_s", None)
        rtt_s = None if median_rtt_s is None else median_rtt_s(now_s - _RTT_WINDOW_S)
        self._rtt_cache = (now_s, rtt_s)
        return rtt_s

    def _default_timeout_s(self, two_levels: bool = False) -> float:
        timeout_s = self.config.matchmaking_time_s + self.config.allreduce_timeout_s
        if two_levels:  # the top round, then the spread
            timeout_s += self.config.top_round_timeout_s + self.config.allreduce_timeout_s
        return timeout_s

    async def _find_top(
        self, key: str, weight: float, timeout_s: float, options: SearchOptions
    ) -> MatchResult:
        """The delegate's search at the second level (:class:`averaging.levels.SecondLevel`)."""
        return await self._matchmaker.find_group(
            key,
            weight=weight,
            numel=self.numel,
            compression=self._compression,
            timeout_s=timeout_s,
            options=options,
        )

    def _check_step(self, weight: float, timeout_s: float | None) -> tuple[float, float]:
        if self._closed:
            raise AveragingError("the averager is closed")
        if not valid_weight(weight):
            raise ConfigError(f"weight must be 0 or a number in [2**-20, 2**53], got {weight!r}")
        if timeout_s is None:
            timeout_s = self._default_timeout_s()
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        return float(weight), float(timeout_s)

    async def _average(
        self,
        key: str,
        group: GroupInfo,
        phase_s: dict[str, float],
        timeout_s: float,
        waits: Mapping[str, float],
        *,
        top: TopRound | None = None,
    ) -> RoundResult:
        """Average with ``group`` (and, when it is a row, at the second level), then scatter."""
        second = self._second if group.top_rows else None
        result = await self._group_rounds.average(group, timeout_s, waits, second=second, top=top)
        return await self._end(key, result, phase_s, waits)

    async def _end(
        self,
        key: str,
        result: RoundResult,
        phase_s: dict[str, float],
        waits: Mapping[str, float],
    ) -> RoundResult:
        """Scatter what the levels left in the flat vector; the round's result."""
        result = await self._group_rounds.end(result, phase_s, waits)
        return self._finish(key, result, phase_s["matchmaking"])

    def _finish(self, key: str, result: RoundResult, matchmaking_s: float) -> RoundResult:
        result = dataclasses.replace(
            result, matchmaking_s=matchmaking_s, search_key=self._search_key
        )
        if not result.levels and result.averaged:
            result = dataclasses.replace(result, num_reached=max(1, len(result.averaged_with)))
        self._layout.note(self._epoch, result)
        if self._matchmaker is not None and result.status in ("ok", "partial"):
            # a member dropped from the round (bad data, a stall) is nobody's partner
            self._matchmaker.note_round(set(result.members) - set(result.dropped_peers))
        self.num_rounds += 1
        if result.status != "ok":
            logger.warning(
                "averaging round %s %s: %s (group of %d, %.0f%% averaged, dropped %s)",
                key,
                result.status,
                result.reason,
                len(result.members),
                100 * result.averaged_fraction,
                ", ".join(p[:8] for p in result.dropped_peers) or "nobody",
            )
        return result
