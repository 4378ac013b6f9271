"""What a P:D sweep leaves behind: results.json, report.md and PNG plots."""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from baton.benchmarks import elastic_report
from baton.benchmarks.metrics import Stats, Summary
from baton.benchmarks.presence import host_description
from baton.benchmarks.report import write_json
from baton.benchmarks.sweep_config import SweepConfig, SweepPoint

PLOTS = {
    "goodput": "goodput_per_worker.png",
    "ttft": "ttft.png",
    "tpot": "tpot.png",
}


def write_sweep_outputs(config: SweepConfig, points: list[SweepPoint]) -> list[Path]:
    """Write results.json, the plots and report.md into `config.out_dir`; return their paths."""
    results = write_json(
        {
            "config": _config_dict(config),
            "points": [
                {
                    "shape": p.shape,
                    "workers": p.workers,
                    "rate": p.rate,
                    "goodput_per_worker": p.goodput_per_worker,
                    "error": p.error,
                    "partial": p.partial,
                    "ready_s": p.ready_s,
                    "result_file": p.result_file,
                    "summary": None if p.summary is None else msgspec.to_builtins(p.summary),
                    "phases": p.phases,
                    "planner_decisions": p.planner,
                    "migrations": p.migrations,
                    "repeat": p.repeat,
                }
                for p in points
            ],
        },
        config.out_dir / "results.json",
    )
    plots = write_plots(points, config.out_dir, config.rate_axis)
    report = config.out_dir / "report.md"
    report.write_text(render_report(config, points, plots), encoding="utf-8")
    return [results, *plots, report]


@dataclass(frozen=True)
class Pooled:
    """The runs of one shape at one rate that measured every worker of the shape: one a
    repeat (`--repeats`)."""

    shape: str
    workers: int
    rate: float
    goodputs: tuple[float, ...]  # good requests/s per worker, a run each

    @property
    def median(self) -> float:
        return statistics.median(self.goodputs)


def pooled(points: list[SweepPoint]) -> list[Pooled]:
    """Each (shape, rate) that ran, in the sweep's order."""
    runs: dict[tuple[str, float], list[SweepPoint]] = {}
    for p in points:
        if p.goodput_per_worker is not None and not p.partial:
            runs.setdefault((p.shape, p.rate), []).append(p)
    return [
        Pooled(shape, ps[0].workers, rate, tuple(p.goodput_per_worker or 0.0 for p in ps))
        for (shape, rate), ps in runs.items()
    ]


def best_per_shape(points: list[SweepPoint]) -> dict[str, Pooled]:
    """Each shape's rate with the highest median goodput per worker (runs on every worker
    of the shape only)."""
    best: dict[str, Pooled] = {}
    for q in pooled(points):
        if q.shape not in best or q.median > best[q.shape].median:
            best[q.shape] = q
    return best


def render_report(config: SweepConfig, points: list[SweepPoint], plots: list[Path]) -> str:
    bench = config.bench
    slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in bench.slo.items())
    lines = [
        "# baton P:D sweep",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- device: {host_description()}",
        f"- command: `{config.command_line}`" if config.command_line else "- command: (API)",
        f"- workload: {bench.dataset}, endpoint {bench.endpoint}, input {bench.input_len}, "
        f"output {bench.output_len}, range ratio {bench.range_ratio:g}, burstiness "
        f"{bench.burstiness:g}, requests {bench.num_requests or '-'}, duration "
        f"{bench.duration_s or '-'} s, warmup {bench.warmup}, seed {bench.seed} (plus i at "
        "the i-th rate: fresh prompts)",
        *(
            [
                f"- trace: {bench.dataset_path}, time scale {bench.time_scale:g} / rate, "
                f"max input {bench.max_input_len or '-'}, max output {bench.max_output_len or '-'}, "
                f"conversations kept {bench.conversation_sample:g}"
            ]
            if config.replays_trace
            else []
        ),
        *([f"- phases: {bench.phases} (rates x the sweep's rate)"] if bench.phases else []),
        f"- SLO: {slo or 'none (goodput = successful requests/s)'}",
        f"- model: {config.model_dir or 'built-in tiny model'}",
        "",
        "## Best shape for the SLOs",
        "",
    ]
    best = best_per_shape(points)
    repeated = config.repeats > 1
    if best:
        ranking = sorted(best.values(), key=lambda q: q.median, reverse=True)
        winner = ranking[0]
        median = f"median of {len(winner.goodputs)} runs, " if repeated else ""
        lines += [
            f"**{winner.shape}**: {winner.median:.3f} good requests/s per worker "
            f"({median}at {config.at(winner.rate)}, {winner.workers} workers).",
            "",
            f"| shape | workers | best goodput / worker (req/s) | at ({config.rate_axis}) |",
            "|---|---:|---:|---:|",
        ]
        lines += [f"| {q.shape} | {q.workers} | {q.median:.3f} | {q.rate:g} |" for q in ranking]
        if repeated:
            lines.append("")
            lines.append("Goodput per worker: the median of the point's runs.")
    else:
        if any(p.partial for p in points):
            lines.append(
                "No shape completed a run on all its workers; runs on a partial cluster "
                "are not ranked."
            )
        else:
            lines.append("No shape completed a run.")
    lines += _repeats_table(points) if repeated else []
    lines += ["", "## All runs", "", *_results_table(points, repeated), ""]
    lines += _placements_table(points, repeated)
    lines += _predictions_table(points, repeated)
    lines += elastic_report.render(points, {rate: config.at(rate) for rate in config.rates})
    failures = [p for p in points if p.error]
    if failures:
        lines += ["## Errors", ""]
        lines += [
            f"- {p.shape} @ {config.at(p.rate)}: {_one_line(p.error or '')}" for p in failures
        ]
        lines.append("")
    partial = [p for p in points if p.partial]
    if partial:
        lines += [
            "## Partial clusters",
            "",
            "A worker left these runs: they measured fewer workers than the shape has.",
            "",
        ]
        lines += [f"- {p.shape} @ {config.at(p.rate)}: {p.partial}" for p in partial]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{path.stem}]({path.name})" for path in plots]
        lines.append("")
    return "\n".join(lines)


def _repeats_table(points: list[SweepPoint]) -> list[str]:
    """Each point's goodput over its runs: the median, the lowest and the highest."""
    rows = [
        "",
        "## Repeats",
        "",
        "Goodput (good requests/s) of each point's runs, each on a fresh cluster.",
        "",
        "| shape | rate | runs | median | lowest | highest | each run |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for q in pooled(points):
        total = [g * q.workers for g in q.goodputs]
        rows.append(
            f"| {q.shape} | {q.rate:g} | {len(total)} | {q.median * q.workers:.2f} "
            f"| {min(total):.2f} | {max(total):.2f} | {', '.join(f'{g:.2f}' for g in total)} |"
        )
    return rows


def _label(p: SweepPoint, repeated: bool) -> str:
    """A run's shape as a table shows it: `1P1D`, or `1P1D r2` where the sweep repeats."""
    return f"{p.shape} r{p.repeat + 1}" if repeated else p.shape


def _results_table(points: list[SweepPoint], repeated: bool = False) -> list[str]:
    header = (
        "| shape | workers | rate | completed | failed | req/s | goodput | goodput / worker "
        "| TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 |"
    )
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        s = p.summary
        if s is None:
            rows.append(
                f"| {_label(p, repeated)} | {p.workers} | {p.rate:g} | failed to run |" + " |" * 10
            )
            continue
        workers = f"{p.workers} (partial)" if p.partial else str(p.workers)
        rows.append(
            f"| {_label(p, repeated)} | {workers} | {p.rate:g} | {s.completed} | {s.failed} "
            f"| {s.request_throughput:.2f} | {s.goodput:.2f} | {p.goodput_per_worker:.3f} "
            f"| {_ms(s.ttft, 'p50')} | {_ms(s.ttft, 'p99')} | {_ms(s.tpot, 'p50')} "
            f"| {_ms(s.tpot, 'p99')} | {_ms(s.e2e, 'p50')} | {_ms(s.e2e, 'p99')} |"
        )
    rows.append("")
    rows.append("Latencies in ms, measured from each request's scheduled send time.")
    return rows


def _placements_table(points: list[SweepPoint], repeated: bool = False) -> list[str]:
    """Where each run's prompts were computed, by placement kind (`baton_timings`), for
    the runs of shapes with prefill and decode workers: requests, and prompt tokens
    computed (not cached). Empty when no run's server named a placement."""
    placed = [
        (p, p.summary.placements)
        for p in points
        if p.summary is not None and set(p.summary.placements) - {"aggregated"}
    ]
    if not placed:
        return []
    kinds = sorted({kind for _, uses in placed for kind in uses} - {"aggregated"})
    handed = any(use.handed_back for _, uses in placed for use in uses.values())
    rows = [
        "## Placements",
        "",
        "Requests (and prompt tokens computed, thousands) by where their prompt was computed"
        + (
            "; handed back: placed again after a decode worker handed their prompt back unstarted."
            if handed
            else "."
        ),
        "",
        "| shape | rate | " + " | ".join(kinds) + (" | handed back |" if handed else " |"),
        "|---|---:|" + "---:|" * (len(kinds) + handed),
    ]
    for p, uses in placed:
        cells = []
        for kind in kinds:
            use = uses.get(kind)
            if use is None:
                cells.append("0")
            elif use.prefill_tokens is None:
                cells.append(str(use.requests))
            else:
                cells.append(f"{use.requests} ({use.prefill_tokens / 1000:.0f}k)")
        if handed:
            cells.append(str(sum(use.handed_back for use in uses.values())))
        rows.append(f"| {_label(p, repeated)} | {p.rate:g} | " + " | ".join(cells) + " |")
    return [*rows, ""]


def _predictions_table(points: list[SweepPoint], repeated: bool = False) -> list[str]:
    """How far the cost placement's predicted TTFT of each request was from the router's
    (`PlacementUse.ttft_error`), by run and placement kind. Empty when no run's router
    predicted any."""
    rows = []
    for p in points:
        if p.summary is None:
            continue
        for kind, use in p.summary.placements.items():
            e = use.ttft_error
            if e is not None:
                rows.append(
                    f"| {_label(p, repeated)} | {p.rate:g} | {kind} | {e.count} "
                    f"| {e.p50 * 1000:+.0f} | {e.p90 * 1000:+.0f} | {e.p99 * 1000:+.0f} |"
                )
    if not rows:
        return []
    return [
        "## TTFT as the cost placement predicted it",
        "",
        "The router's TTFT (its phases up to the first token) less the prediction, in ms:",
        "positive, later than predicted.",
        "",
        "| shape | rate | placement | requests | p50 | p90 | p99 |",
        "|---|---:|---|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def write_plots(
    points: list[SweepPoint], out_dir: Path, rate_axis: str = "request rate (req/s)"
) -> list[Path]:
    """goodput per worker, TTFT and TPOT against rate, one line per shape (where a sweep
    repeats, through the median of each rate's runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(p.shape for p in points))
    written = []

    def series(shape: str, value: Callable[[SweepPoint], float | None]) -> tuple[list, list]:
        at: dict[float, list[float]] = {}
        for p in points:
            if p.shape == shape:
                y = value(p)
                at.setdefault(p.rate, []).extend([] if y is None else [y])
        return list(at), [statistics.median(ys) if ys else math.nan for ys in at.values()]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in shapes:
        ax.plot(*series(shape, lambda p: p.goodput_per_worker), marker="o", label=shape)
    ax.set(
        xlabel=rate_axis,
        ylabel="goodput per worker (req/s)",
        title="goodput per worker",
    )
    written.append(_save(fig, ax, out_dir / PLOTS["goodput"]))

    for metric in ("ttft", "tpot"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
        for ax, quantile in zip(axes, ("p50", "p99"), strict=True):
            for shape in shapes:
                xs, ys = series(shape, _stat_getter(metric, quantile))
                ax.plot(xs, ys, marker="o", label=shape)
            ax.set(
                xlabel=rate_axis,
                ylabel=f"{metric.upper()} {quantile} (ms)",
                title=f"{metric.upper()} {quantile}",
            )
        written.append(_save(fig, axes[-1], out_dir / PLOTS[metric]))
    plt.close("all")
    return written


def _save(fig, ax, path: Path) -> Path:
    ax.legend()
    for each in fig.axes:
        each.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _stat_getter(metric: str, quantile: str) -> Callable[[SweepPoint], float | None]:
    """A point's `metric` (ttft, tpot) at `quantile` (p50, p99) in ms, if it has one."""

    def get(point: SweepPoint) -> float | None:
        summary: Summary | None = point.summary
        stats: Stats | None = None if summary is None else getattr(summary, metric)
        return None if stats is None else float(getattr(stats, quantile)) * 1000.0

    return get


def _ms(stats: Stats | None, quantile: str) -> str:
    return "n/a" if stats is None else f"{getattr(stats, quantile) * 1000:.1f}"


def _config_dict(config: SweepConfig) -> dict[str, object]:
    return {
        "shapes": [s.name for s in config.shapes],
        "rates": list(config.rates),
        "model_dir": config.model_dir,
        "launcher_cmd": config.launcher_cmd,
        "command_line": config.command_line,
        "bench": config.bench.describe(),
    }


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
