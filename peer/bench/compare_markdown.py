"""The Markdown of ``peer bench compare``: tables ready for docs/BENCHMARKS.md, every cell with
its command, and per row the median of the pairs' native / hivemind ratios with their spread."""

from __future__ import annotations

from typing import Any


def _value(cell: dict[str, Any], field: str) -> Any:
    result = cell.get("result") or {}
    return result.get(field)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _ratio(numerator: Any, denominator: Any) -> str:
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def _paired(cell: dict[str, Any], numerator: Any, denominator: Any) -> str:
    """The row's median pairwise ratio with its IQR and number of pairs (a row measured once
    per backend: the plain ratio)."""
    ratio = cell.get("ratio")
    if not ratio:
        return _ratio(numerator, denominator)
    if ratio["num_pairs"] == 1:
        return f"{ratio['ratio_p50']:.2f}x (1 pair)"
    return f"{ratio['ratio_p50']:.2f}x (IQR {ratio['ratio_iqr']:.2f}, {ratio['num_pairs']} pairs)"


def _shown(cell: dict[str, Any], field: str, digits: int = 3) -> str:
    if cell.get("error"):
        return "failed"
    return _fmt(_value(cell, field), digits)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _commands(rows: list[list[dict[str, Any]]]) -> list[str]:
    lines = ["", "Commands (one per cell, in the order run):", "", "```"]
    lines += [cell["command"] for row in rows for cell in row]
    lines.append("```")
    errors = [f"- `{c['command']}`: {c['error']}" for row in rows for c in row if c["error"]]
    if errors:
        lines += ["", "Failed cells:", "", *errors]
    return lines


def _allreduce_md(rows: list[list[dict[str, Any]]]) -> list[str]:
    body = []
    for native, hive in rows:
        result = native.get("result") or hive.get("result") or {}
        body.append(
            [
                _fmt(result.get("size")),
                _fmt(result.get("peers")),
                str(result.get("compression", "-")),
                _shown(native, "round_s_p50"),
                _shown(hive, "round_s_p50"),
                _paired(native, _value(hive, "round_s_p50"), _value(native, "round_s_p50")),
                _shown(native, "allreduce_s_p50"),
                _shown(hive, "allreduce_s_p50"),
                _shown(native, "matchmaking_s_p50"),
                _shown(hive, "matchmaking_s_p50"),
                _shown(native, "max_abs_err", 2),
                _shown(hive, "max_abs_err", 2),
            ]
        )
    header = [
        "values", "peers", "compression", "native round s", "hivemind round s",
        "native speedup", "native all-reduce s", "hivemind all-reduce s",
        "native matchmaking s", "hivemind matchmaking s", "native max err", "hivemind max err",
    ]  # fmt: skip
    return ["### All-reduce round (p50 of the slowest peer)", "", *_table(header, body)]


def _train_md(rows: list[list[dict[str, Any]]]) -> list[str]:
    body, memory = [], []
    for native, hive in rows:
        result = native.get("result") or hive.get("result") or {}
        task, peers = str(result.get("task", "-")), _fmt(result.get("peers"))
        body.append(
            [
                task,
                peers,
                _shown(native, "samples_per_s", 4),
                _shown(hive, "samples_per_s", 4),
                _paired(native, _value(native, "samples_per_s"), _value(hive, "samples_per_s")),
                _shown(native, "final_loss"),
                _shown(hive, "final_loss"),
                _shown(native, "eval_loss"),
                _shown(hive, "eval_loss"),
                _shown(native, "rounds"),
                _shown(hive, "rounds"),
                _shown(native, "round_overhead_s"),
                _shown(hive, "round_overhead_s"),
            ]
        )
        memory.append(
            [
                task,
                peers,
                _shown(native, "peak_rss_mb_per_peer", 4),
                _shown(hive, "peak_rss_mb_per_peer", 4),
                _shown(native, "peak_pss_mb_per_peer", 4),
                _shown(hive, "peak_pss_mb_per_peer", 4),
                _ratio(*(_value(c, "peak_pss_mb_per_peer") for c in (hive, native))),
            ]
        )
    header = [
        "task", "peers", "native samples/s", "hivemind samples/s", "native / hivemind",
        "native final loss", "hivemind final loss", "native eval loss", "hivemind eval loss",
        "native epochs", "hivemind epochs", "native s/round waiting", "hivemind s/round waiting",
    ]  # fmt: skip
    memory_header = [
        "task", "peers", "native RSS MiB", "hivemind RSS MiB (+p2pd)", "native PSS MiB",
        "hivemind PSS MiB (+p2pd)", "hivemind / native (PSS)",
    ]  # fmt: skip
    return [
        "### End to end (samples/s summed over peers; losses after the fixed time)",
        "",
        *_table(header, body),
        "",
        "### Resident memory per training peer (peak of its process tree)",
        "",
        *_table(memory_header, memory),
    ]


def _dht_md(rows: list[list[dict[str, Any]]]) -> list[str]:
    body = []
    for native, hive in rows:
        body.append(
            [
                _fmt(_value(native, "nodes") or _value(hive, "nodes")),
                _shown(native, "get_p50_ms"),
                _shown(hive, "get_p50_ms"),
                _paired(native, _value(hive, "get_p50_ms"), _value(native, "get_p50_ms")),
                _shown(native, "store_p50_ms"),
                _shown(hive, "store_p50_ms"),
                _ratio(_value(hive, "store_p50_ms"), _value(native, "store_p50_ms")),
                _shown(native, "get_ok"),
                _shown(hive, "get_ok"),
                _shown(native, "rss_mb_per_node"),
                _shown(hive, "rss_mb_per_node"),
            ]
        )
    header = [
        "nodes", "native get p50 ms", "hivemind get p50 ms", "native speedup (get)",
        "native store p50 ms", "hivemind store p50 ms", "native speedup (store)",
        "native get ok", "hivemind get ok", "native MiB/node", "hivemind MiB/node",
    ]  # fmt: skip
    return ["### DHT latency", "", *_table(header, body)]


def render_markdown(report: dict[str, Any]) -> str:
    """The sweep's tables, commands and machine state as Markdown."""
    machine = report["machine"]
    lines = [
        f"Measured {machine['time_utc']} on {machine['cpu_count']} cores, "
        f"{machine['memory_gb']} GiB, load average {machine['load_average']} at the start; "
        f"Python {machine['python']}, torch {machine['torch']}, hivemind {machine['hivemind']}.",
    ]
    for part, render in (("allreduce", _allreduce_md), ("train", _train_md), ("dht", _dht_md)):
        if report.get(part):
            lines += ["", *render(report[part]), *_commands(report[part])]
    return "\n".join(lines) + "\n"
