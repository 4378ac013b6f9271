"""How one benchmark's results are shown (rich tables) and saved (JSON)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from baton.benchmarks.config import TRACE_DATASETS
from baton.benchmarks.metrics import (
    SERVER_TIMING_FIELDS,
    Summary,
    latency_series,
    percentile_name,
)
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
    if c.dataset in TRACE_DATASETS:
        rate = f"trace x{c.time_scale:g}"
    if c.phases:
        rate = f"phases {c.phases}"
    console.print(
        f"[bold]baton bench serve[/]  {c.base_url}  model [cyan]{result.model}[/]  "
        f"{c.endpoint}  dataset {c.dataset}  rate {rate}"
        + (f"  max-concurrency {c.max_concurrency}" if c.max_concurrency else "")
    )
    if result.cluster is not None and result.cluster.start.workers is not None:
        console.print(f"cluster at the start: {result.cluster.start.describe()}")
    console.print(latency_table(result))
    console.print(throughput_table(s))
    if result.prefix_reuse is not None:
        seen = "n/a" if s.cache_hit_ratio is None else f"{s.cache_hit_ratio * 100:.1f}%"
        console.print(
            f"trace: an unbounded prefix cache would serve {result.prefix_reuse * 100:.1f}% "
            f"of the prompt tokens; the server's served {seen}"
        )
    if result.phases:
        console.print(phase_table(result))
    console.print(server_timing_table(s))
    if s.placements:
        console.print(placement_table(s))
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


def latency_table(result: BenchResult) -> Table:
    """The latencies of `--percentile-metrics` at `--metric-percentiles`."""
    config = result.config
    table = Table(title="latency (ms, from scheduled send time)")
    quantiles = sorted(set(config.metric_percentiles))
    columns = ["metric", "mean", *(f"p{percentile_name(q)}" for q in quantiles), "max", "n"]
    for column in columns:
        table.add_column(column, justify="left" if column == "metric" else "right")
    done = [r for r in result.records if r.sent and not r.warmup and r.success]
    series = latency_series(done)
    for name in config.percentile_metrics:
        values = np.asarray(series[name], dtype=np.float64)
        label = "E2E" if name == "e2el" else name.upper()
        if values.size == 0:
            table.add_row(label, *([NOT_AVAILABLE] * (len(columns) - 2)), "0")
            continue
        cells = [values.mean(), *np.percentile(values, quantiles), values.max()]
        table.add_row(label, *(ms(float(v)) for v in cells), str(values.size))
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
    if s.cache_hit_ratio is not None:
        table.add_row(
            "prompt tokens cached (server's prefix cache)",
            f"{s.cached_prompt_tokens} ({s.cache_hit_ratio * 100:.1f}%)",
        )
        table.add_row("prompt tokens computed (prefill)", str(s.prefill_tokens))
    slo = ", ".join(f"{k}<={ms(v)}ms" for k, v in s.slo.items()) or "none given"
    table.add_row(f"goodput (req/s, SLO: {slo})", f"{s.goodput:.2f}")
    if s.slo_attainment is not None:
        table.add_row("SLO attainment", f"{s.slo_attainment * 100:.1f}%")
    return table


def phase_table(result: BenchResult) -> Table:
    """Each phase of a `--phases` run, then the whole run: what a changing mix did."""
    table = Table(title="phases (goodput req/s over each one's span; p90 in ms)")
    table.add_column("phase", no_wrap=True)
    for column in ("s", "ok", "failed", "goodput", "SLO met", "TTFT p90", "TPOT p90"):
        table.add_column(column, justify="right")
    rows = [(p.phase, f"{p.start_s:.0f}-{p.end_s:.0f}", p.summary) for p in result.phases]
    rows.append(("whole run", "", result.summary))
    for name, window, s in rows:
        met = NOT_AVAILABLE if s.slo_attainment is None else f"{s.slo_attainment * 100:.1f}%"
        table.add_row(
            name, window, str(s.completed), str(s.failed), f"{s.goodput:.2f}", met,
            ms(s.ttft.p90 if s.ttft else None), ms(s.tpot.p90 if s.tpot else None),
        )  # fmt: skip
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


def placement_table(s: Summary) -> Table:
    """Where baton prefilled the completed requests, and what each way computed."""
    table = Table(title="placements (baton_timings)")
    columns: tuple[str, ...] = (
        "placement",
        "requests",
        "prompt tokens",
        "cached",
        "prefill computed",
        "handed back",
    )
    predicted = any(use.ttft_error is not None for use in s.placements.values())
    if predicted:  # the cost placement's: the router's TTFT less its prediction
        columns += ("TTFT - predicted p50 (ms)", "p90 (ms)")
    for column in columns:
        table.add_column(column, justify="left" if column == "placement" else "right")
    for kind, use in s.placements.items():
        cached = NOT_AVAILABLE if use.cached_tokens is None else str(use.cached_tokens)
        prefill = NOT_AVAILABLE if use.prefill_tokens is None else str(use.prefill_tokens)
        row = [
            kind,
            str(use.requests),
            str(use.prompt_tokens),
            cached,
            prefill,
            str(use.handed_back),
        ]
        if predicted:
            e = use.ttft_error
            row += (
                [NOT_AVAILABLE] * 2 if e is None else [f"{e.p50 * 1e3:+.0f}", f"{e.p90 * 1e3:+.0f}"]
            )
        table.add_row(*row)
    return table


def _num(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.1f}"
