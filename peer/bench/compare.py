"""``peer bench compare``: the same workloads on the native backend and on hivemind, in one run.

It runs, for each backend, the benchmarks ``peer bench allreduce``, ``peer bench train`` and
``peer bench dht`` run (the same functions, called in this process one after another, so the two
backends see the same machine state), and writes Markdown tables ready for docs/BENCHMARKS.md:
every cell with the exact command that reproduces it, and the ratio native/hivemind measured in
this run. A workload that fails on one backend gets its error in the table; the sweep goes on.

Ratios: for times (all-reduce round, DHT latency) and memory, hivemind's value / ours (how many
times faster or smaller we are); for samples/s, ours / hivemind's.

Each cell runs ``pairs`` times, the two backends taking turns (native, hivemind, hivemind, native,
...: :func:`peer.bench.pairs.pair_order`), and each pair gives one ratio: a row's ratio is the
median of its pairs' ratios, shown with their IQR and count, and each cell's figures are those of
its run with the median value. Runs next to each other in time see nearly the same machine,
which one run per backend, minutes apart on a shared host, does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import platform
import time
from collections.abc import Callable
from typing import Any

import psutil

from peer.bench.pairs import paired_runs, pairwise_ratios, spread

logger = logging.getLogger(__name__)
BACKENDS = ("native", "hivemind")
PARTS = ("allreduce", "train", "dht")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """One ``peer bench compare`` sweep; the defaults are the full sweep of issue #8.

    Attributes:
        parts: which benchmarks to run (``allreduce``, ``train``, ``dht``).
        sizes: all-reduce sizes, float32 values per peer.
        allreduce_peers: all-reduce group sizes.
        compressions: all-reduce wire formats.
        rounds: measured all-reduce rounds per cell (after one warm-up).
        train_peers: peer counts of the train benchmark.
        tasks: tasks of the train benchmark.
        train_seconds: training seconds per train cell.
        threads: cores the train benchmark uses (peers split them).
        dht_nodes, dht_keys: nodes and values of the DHT benchmark.
        pairs: runs of each cell per backend, the backends taking turns.
    """

    parts: tuple[str, ...] = PARTS
    sizes: tuple[int, ...] = (1_000_000, 10_000_000, 25_000_000)
    allreduce_peers: tuple[int, ...] = (2, 4)
    compressions: tuple[str, ...] = ("none", "fp16", "uint8")
    rounds: int = 3
    train_peers: tuple[int, ...] = (1, 2, 4)
    tasks: tuple[str, ...] = ("synthetic", "charlm")
    train_seconds: float = 20.0
    threads: int | None = None
    dht_nodes: int = 8
    dht_keys: int = 50
    pairs: int = 3

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"parts: {sorted(unknown)} not in {', '.join(PARTS)}")
        if any(n < 2 for n in self.allreduce_peers):
            raise ValueError("allreduce_peers: an all-reduce needs at least 2 peers")
        for name in ("rounds", "dht_nodes", "dht_keys", "pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class Cell:
    """One workload on one backend: the command that reproduces it and its JSON (or error).

    After :func:`paired_row`: ``result`` is the run with the median value, ``runs`` every run's
    result (None for a failed one) and ``ratio`` the row's pairwise ratios (both cells of a row
    hold the same).
    """

    backend: str
    command: str
    result: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0
    runs: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)
    ratio: dict[str, Any] | None = None


# per part: (field, whether the native / hivemind ratio is hivemind's value over ours)
RATIO_FIELDS = {
    "allreduce": ("round_s_p50", True),
    "train": ("samples_per_s", False),
    "dht": ("get_p50_ms", True),
}


def _measure(backend: str, command: str, run: Callable[[], dict[str, Any]]) -> Cell:
    cell = Cell(backend, command)
    start = time.monotonic()
    logger.warning("bench compare: %s", command)
    try:
        cell.result = run()
    except Exception as e:  # one failed workload is a cell with its error; the sweep goes on
        cell.error = f"{type(e).__name__}: {e}"[:200]
        logger.warning("bench compare: failed: %s", cell.error)
    cell.seconds = time.monotonic() - start
    return cell


def paired_row(part: str, num_pairs: int, measures: dict[str, Callable[[], Cell]]) -> list[Cell]:
    """Run each backend's ``measure`` ``num_pairs`` times, taking turns; returns one cell per
    backend (see :class:`Cell`) with the pairwise ratios of ``RATIO_FIELDS[part]``."""
    field, hivemind_over_native = RATIO_FIELDS[part]
    runs = dict(
        zip(
            BACKENDS,
            paired_runs(*(measures[b] for b in BACKENDS), num_pairs=num_pairs),
            strict=True,
        )
    )
    values = {b: [(c.result or {}).get(field) for c in cells] for b, cells in runs.items()}
    top, bottom = ("hivemind", "native") if hivemind_over_native else ("native", "hivemind")
    ratios = pairwise_ratios(values[top], values[bottom])
    ratio = {"field": field, **spread(ratios).fields(3)} if ratios else None
    row = []
    for cells in runs.values():
        good = sorted((c for c in cells if c.result is not None), key=lambda c: c.result[field])
        cell = good[(len(good) - 1) // 2] if good else cells[0]
        cell.seconds = sum(c.seconds for c in cells)
        cell.runs = [c.result for c in cells]
        cell.ratio = ratio
        row.append(cell)
    return row


def paired_allreduce(
    run: Callable[[], dict[str, Any]], other: Callable[[], dict[str, Any]], *, num_pairs: int
) -> dict[str, Any]:
    """``peer bench allreduce --compare``: ``run`` and ``other`` take turns ``num_pairs`` times.

    Returns the contract fields of ``run``'s run with the median ``round_s_p50``, ``pairs`` and
    ``compare``: ``other``'s median run, with ``ratio_p50, ratio_iqr, ratio_min, ratio_max,
    num_pairs, ratios`` of ``other``'s round_s_p50 / ``run``'s (above 1: ``run`` is faster).
    """
    mine, theirs = paired_runs(run, other, num_pairs=num_pairs)
    ratios = pairwise_ratios([r["round_s_p50"] for r in theirs], [r["round_s_p50"] for r in mine])

    def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
        return sorted(results, key=lambda r: r["round_s_p50"])[(len(results) - 1) // 2]

    return median_run(mine) | {
        "pairs": num_pairs,
        "runs_round_s_p50": [r["round_s_p50"] for r in mine],
        "compare": median_run(theirs)
        | {"runs_round_s_p50": [r["round_s_p50"] for r in theirs], **spread(ratios).fields(3)},
    }


def allreduce_cells(config: CompareConfig) -> list[list[Cell]]:
    from averaging.bench.allreduce import run_allreduce_bench
    from peer.hivemind.bench import run_hivemind_allreduce_bench

    runners = {"native": run_allreduce_bench, "hivemind": run_hivemind_allreduce_bench}
    rows = []
    for size in config.sizes:
        for num_peers in config.allreduce_peers:
            for compression in config.compressions:
                args = (num_peers, size, compression, config.rounds)
                measures = {
                    backend: functools.partial(
                        _measure,
                        backend,
                        f"peer bench allreduce --backend {backend} --peers {num_peers} "
                        f"--size {size} --compression {compression} "
                        f"--rounds {config.rounds} --json",
                        functools.partial(runners[backend], *args),
                    )
                    for backend in BACKENDS
                }
                rows.append(paired_row("allreduce", config.pairs, measures))
    return rows


def train_cells(config: CompareConfig) -> list[list[Cell]]:
    from peer.bench.train import run_train_bench
    from peer.bench.train_config import TrainBenchConfig

    rows = []
    threads = {} if config.threads is None else {"num_threads": config.threads}
    threads_flag = "" if config.threads is None else f" --threads {config.threads}"
    for task in config.tasks:
        for num_peers in config.train_peers:
            measures = {}
            for backend in BACKENDS:
                bench = TrainBenchConfig(
                    backend=backend,
                    num_peers=num_peers,
                    task=task,
                    seconds=config.train_seconds,
                    run_baseline=False,
                    **threads,
                )
                measures[backend] = functools.partial(
                    _measure,
                    backend,
                    f"peer bench train --backend {backend} --peers {num_peers} --task {task} "
                    f"--seconds {config.train_seconds:g}{threads_flag} --no-baseline --json",
                    functools.partial(run_train_bench, bench),
                )
            rows.append(paired_row("train", config.pairs, measures))
    return rows


def dht_cells(config: CompareConfig) -> list[list[Cell]]:
    from dht.tools.bench import run_dht_bench
    from peer.hivemind.bench import run_hivemind_dht_bench

    kwargs = {"num_nodes": config.dht_nodes, "num_keys": config.dht_keys}
    runners = {
        "native": lambda: asyncio.run(run_dht_bench(**kwargs)),
        "hivemind": lambda: run_hivemind_dht_bench(**kwargs),
    }
    measures = {
        backend: functools.partial(
            _measure,
            backend,
            f"peer bench dht --backend {backend} --nodes {config.dht_nodes} "
            f"--keys {config.dht_keys} --json",
            runners[backend],
        )
        for backend in BACKENDS
    }
    return [paired_row("dht", config.pairs, measures)]


def run_compare(config: CompareConfig) -> dict[str, Any]:
    """Run the sweep; returns ``{machine, allreduce, train, dht}`` (each a list of rows, a row
    a list of cells as dicts: backend, command, result, error, seconds)."""
    makers = {"allreduce": allreduce_cells, "train": train_cells, "dht": dht_cells}
    out: dict[str, Any] = {"machine": machine_state()}
    for part in PARTS:
        rows = makers[part](config) if part in config.parts else []
        out[part] = [[dataclasses.asdict(cell) for cell in row] for row in rows]
    return out


def machine_state() -> dict[str, Any]:
    """What the figures were measured on: cores, memory, load, Python, torch, hivemind."""
    import torch

    try:
        import hivemind

        hivemind_version = hivemind.__version__
    except ImportError:
        hivemind_version = None
    return {
        "cpu_count": psutil.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": [round(x, 2) for x in psutil.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hivemind": hivemind_version,
        "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
