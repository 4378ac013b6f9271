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
from typing import TYPE_CHECKING

from rich.console import Console

from baton.benchmarks.config import BenchConfig, BenchConfigError, ResultFiles
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
    _num_prompts(serve)

    sweep = commands.add_parser(
        "pd-sweep",
        help="compare P:D cluster shapes over request rates",
        description="Start a local cluster per shape (`baton up`), run the workload at "
        "each rate, and write report.md, PNG plots and results.json.",
    )
    add_options(sweep, SweepConfig)
    add_options(sweep, BenchConfig, exclude=SWEPT)
    _num_prompts(sweep)


def _num_prompts(parser: argparse.ArgumentParser) -> None:
    """`--num-prompts`: vLLM's name of `--num-requests`."""
    parser.add_argument("--num-prompts", dest="num_requests", type=int, help=argparse.SUPPRESS)


def config_from_args(
    args: argparse.Namespace, *, exclude: tuple[str, ...] = (), **fixed: object
) -> BenchConfig:
    """The BenchConfig the flags describe; `fixed` sets fields the flags do not have."""
    values = option_values(BenchConfig, args, exclude=exclude)
    values["progress"] = values.get("progress", True) and sys.stdout.isatty()
    return BenchConfig(**{**values, **fixed})


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    values = option_values(SweepConfig, args)
    bench = config_from_args(args, exclude=SWEPT, request_rate=values["rates"][0])
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
    from baton.benchmarks.report import print_result, write_json
    from baton.benchmarks.serve import BenchError, run_benchmark

    config = config_from_args(args)
    files = ResultFiles(**option_values(ResultFiles, args))
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
        targets.append(files.result_dir / (files.result_filename or _result_name(result)))
    for target in targets:
        data = {"command": _command_line(), **result.to_dict()}
        console.print(f"results written to {write_json(data, target)}")
    return 0 if result.summary.completed > 0 and not result.partial else 1


def _run_sweep(args: argparse.Namespace, console: Console) -> int:
    from baton.benchmarks.pd_sweep import run_sweep

    points = run_sweep(sweep_config(args), console)
    measured = [p for p in points if p.summary is not None and not p.partial]
    return 0 if any(p.summary is not None and p.summary.completed for p in measured) else 1


def _result_name(result: BenchResult) -> str:
    rate = result.config.request_rate
    model = result.model.replace("/", "_")
    stamp = result.started_at[:19].replace(":", "").replace("-", "")
    return f"openai-{'inf' if math.isinf(rate) else f'{rate:g}'}qps-{model}-{stamp}.json"


def _command_line() -> str:
    """The exact command, for recorded results."""
    return shlex.join(["baton", *sys.argv[1:]])
