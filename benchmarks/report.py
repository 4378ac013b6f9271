"""How one benchmark's results are shown (rich tables) and saved (JSON)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from baton.benchmarks.metrics import SERVER_TIMING_FIELDS, Stats, Summary
from baton.benchmarks.serve import BenchResult

NOT_AVAILABLE = "n/a"


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats spelled as strings ("inf"), which JSON cannot hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(data: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(data), indent=1) + "\n", encoding="utf-8")
    return path


def ms(seconds: float | None) -> str:
    return NOT_AVAILABLE if seconds is None else f"{seconds * 1000:.1f}"


def print_result(result: BenchResult, console: Console | None = None) -> None:
    """The end-of-run report: latencies, throughput, server breakdown, warnings."""
    console = console or Console()
    s = result.summary
    c = result.config
    rate = "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g} req/s"
    if c.dataset == "trace":
        rate = f"trace x{c.time_scale:g}"
    console.print(
        f"[bold]baton bench serve[/]  {c.base_url}  model [cyan]{result.model}[/]  "
        f"{c.endpoint}  dataset {c.dataset}  rate {rate}"
        + (f"  max-concurrency {c.max_concurrency}" if c.max_concurrency else "")
    )
    if result.cluster is not None and result.cluster.start.workers is not None:
        console.print(f"cluster at the start: {result.cluster.start.describe()}")
    console.print(latency_table(s))
    console.print(throughput_table(s))
    console.print(server_timing_table(s))
    if s.late_launches:
        console.print(
            f"[yellow]client fell behind schedule: {s.late_launches} requests, "
            f"max lag {s.max_launch_lag_s * 1000:.1f} ms[/] (latencies still count from the "
            "scheduled time)"
        )
    if result.partial:
        console.print(
            f"[red]partial cluster: {result.partial}[/]: these numbers measured fewer "
            "workers than the run started with"
        )
    if s.failed:
        console.print(f"[red]{s.failed} requests failed[/]; samples:")
        for sample in s.error_samples:
            console.print(f"  - {sample}", markup=False)


def latency_table(s: Summary) -> Table:
    table = Table(title="latency (ms, from scheduled send time)")
    for column in ("metric", "mean", "p50", "p90", "p99", "max", "n"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    rows: list[tuple[str, Stats | None]] = [
        ("TTFT", s.ttft),
        ("TPOT", s.tpot),
        ("ITL", s.itl),
        ("E2E", s.e2e),
    ]
    for name, stats in rows:
        if stats is None:
            table.add_row(name, *([NOT_AVAILABLE] * 5), "0")
        else:
            values = (stats.mean, stats.p50, stats.p90, stats.p99, stats.max)
            table.add_row(name, *(ms(v) for v in values), str(stats.count))
    return table


def throughput_table(s: Summary) -> Table:
    table = Table(title="throughput", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("requests completed / failed", f"{s.completed} / {s.failed}")
    if s.not_sent:
        table.add_row("not sent (after --duration)", str(s.not_sent))
    table.add_row("duration (s)", f"{s.duration_s:.2f}")
    table.add_row("request throughput (req/s)", f"{s.request_throughput:.2f}")
    table.add_row("input tokens/s", f"{s.input_token_throughput:.1f}")
    table.add_row("output tokens/s", f"{s.output_token_throughput:.1f}")
    table.add_row(
        "mean prompt / output tokens",
        f"{_num(s.mean_prompt_tokens)} / {_num(s.mean_output_tokens)}",
    )
    slo = ", ".join(f"{k}<={ms(v)}ms" for k, v in s.slo.items()) or "none given"
    table.add_row(f"goodput (req/s, SLO: {slo})", f"{s.goodput:.2f}")
    if s.slo_attainment is not None:
        table.add_row("SLO attainment", f"{s.slo_attainment * 100:.1f}%")
    return table


def server_timing_table(s: Summary) -> Table:
    table = Table(title="server-side breakdown (ms, from baton_timings)")
    for column in ("stage", "mean", "p50", "p90"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    names = list(SERVER_TIMING_FIELDS) + [
        n for n in s.server_timings if n not in SERVER_TIMING_FIELDS
    ]
    for name in names:
        stats = s.server_timings.get(name)
        if stats is None:
            table.add_row(name, NOT_AVAILABLE, NOT_AVAILABLE, NOT_AVAILABLE)
        else:
            table.add_row(name, ms(stats.mean), ms(stats.p50), ms(stats.p90))
    return table


def _num(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.1f}"
