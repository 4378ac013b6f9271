"""`baton bench serve` and `baton bench pd-sweep`: flags, and flags -> config.

Every flag is a field of a config dataclass (`BenchConfig`, `ResultFiles`,
`SweepConfig`), declared by `add_options` as every other command's are.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from baton.benchmarks import vllm_flags
from baton.benchmarks.config import TRACE_DATASETS, BenchConfig, BenchConfigError, ResultFiles
from baton.benchmarks.sweep_config import SWEPT, SweepConfig
from baton.common.options import add_options, option_values

if TYPE_CHECKING:
    from baton.benchmarks.serve import BenchResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    serve = commands.add_parser(
        "serve",
        help="open-loop load test of an OpenAI-compatible endpoint",
        description="Send requests at scheduled times (open loop) and report latencies, "
        "throughput and goodput. Latencies count from each request's scheduled time.",
    )
    add_options(serve, BenchConfig)
    add_options(serve, ResultFiles)
    vllm_flags.add_arguments(serve)

    sweep = commands.add_parser(
        "pd-sweep",
        help="compare P:D cluster shapes over request rates",
        description="Start a local cluster per shape (`baton up`), run the workload at "
        "each rate, and write report.md, PNG plots and results.json.",
    )
    add_options(sweep, SweepConfig)
    fields = add_options(sweep, BenchConfig, exclude=SWEPT)
    vllm_flags.add_aliases(sweep, fields)


def config_from_args(
    args: argparse.Namespace, *, exclude: tuple[str, ...] = (), **fixed: object
) -> BenchConfig:
    """The BenchConfig the flags describe (vLLM's spellings translated); `fixed` sets
    fields the flags do not have."""
    values = vllm_flags.apply(args, option_values(BenchConfig, args, exclude=exclude))
    values["progress"] = values.get("progress", True) and sys.stdout.isatty()
    return BenchConfig(**{**values, **fixed})


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    values = option_values(SweepConfig, args)
    # A trace's arrivals, and phases' rates, are their own: a rate speeds them up
    # (SweepConfig.point_config).
    traced = getattr(args, "dataset", None) in TRACE_DATASETS or bool(getattr(args, "phases", ()))
    rate = {} if traced else {"request_rate": values["rates"][0]}
    bench = config_from_args(args, exclude=SWEPT, **rate)
    return SweepConfig(**values, bench=bench, command_line=_command_line())


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        if args.bench_command == "serve":
            return _run_serve(args, console)
        return _run_sweep(args, console)
    except BenchConfigError as e:
        console.print(f"[red]invalid settings:[/] {e}")
        return 2


def _run_serve(args: argparse.Namespace, console: Console) -> int:
    from baton.benchmarks.metrics import detailed_lists
    from baton.benchmarks.report import print_result, write_json
    from baton.benchmarks.serve import BenchError, run_benchmark

    config = config_from_args(args)
    files = ResultFiles(**option_values(ResultFiles, args))
    metadata = vllm_flags.metadata(args)
    try:
        result = asyncio.run(run_benchmark(config, stop_on_signals=True))
    except BenchError as e:
        console.print(f"[red]bench serve:[/] {e}")
        return 1
    print_result(result, console)
    if result.stopped:
        console.print(f"[yellow]{result.stopped}:[/] the results cover the requests it sent")
    targets = [files.out] if files.out is not None else []
    if files.save_result:
        name = files.result_filename or _result_name(result, files.label)
        targets.append(files.result_dir / name)
    data = {"command": _command_line(), **result.to_dict(), **metadata}
    data["label"] = files.label or data["backend"]
    if files.save_detailed:
        data.update(detailed_lists(result.records))
    for target in targets:
        console.print(f"results written to {write_json(data, target)}")
    _plot(result, files, targets, console)
    return 0 if result.summary.completed > 0 and not result.partial else 1


def _run_sweep(args: argparse.Namespace, console: Console) -> int:
    from baton.benchmarks.pd_sweep import run_sweep

    points = run_sweep(sweep_config(args), console)
    measured = [p for p in points if p.summary is not None and not p.partial]
    return 0 if any(p.summary is not None and p.summary.completed for p in measured) else 1


def _plot(result: BenchResult, files: ResultFiles, targets: list[Path], console: Console) -> None:
    """The run's plots into --plots, else beside the first results JSON."""
    from baton.benchmarks import run_plots

    if files.plots is None and not targets:
        return
    if not run_plots.can_plot():
        console.print("[yellow]no plots:[/] matplotlib is not installed (the `plot` extra)")
        return
    folder, prefix = (files.plots, "") if files.plots else run_plots.beside(targets[0])
    title = f"({result.model}, {result.config.dataset})"
    for path in run_plots.write_run_plots(result.records, folder, prefix, title):
        console.print(f"plot written to {path}")


def _result_name(result: BenchResult, label: str | None) -> str:
    """vLLM's name: <label>-<rate>qps[-concurrency<N>]-<model>-<YYYYmmdd-HHMMSS>.json."""
    config = result.config
    label = label or ("openai-chat" if config.endpoint == "chat" else "openai")
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    cap = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    model = result.model.rstrip("/").split("/")[-1]
    day, time = result.started_at[:10].replace("-", ""), result.started_at[11:19]
    return f"{label}-{rate}qps{cap}-{model}-{day}-{time.replace(':', '')}.json"


def _command_line() -> str:
    """The exact command, for recorded results."""
    return shlex.join(["baton", *sys.argv[1:]])
