"""`baton bench serve` and `baton bench pd-sweep`: flags, and flags -> config."""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from baton.benchmarks.config import DATASETS, ENDPOINT_PATHS, BenchConfig, BenchConfigError
from baton.benchmarks.metrics import parse_slo

if TYPE_CHECKING:
    from baton.benchmarks.pd_sweep import Shape
    from baton.benchmarks.serve import BenchResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    serve = commands.add_parser(
        "serve",
        help="open-loop load test of an OpenAI-compatible endpoint",
        description="Send requests at scheduled times (open loop) and report latencies, "
        "throughput and goodput. Latencies count from each request's scheduled time.",
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load")
    serve.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    serve.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second; inf sends all at once (default inf)",
    )
    serve.add_argument("--out", type=Path, default=None, help="write results JSON here")
    serve.add_argument(
        "--save-result",
        action="store_true",
        help="write results JSON into --result-dir (vLLM's flag; --out names a file)",
    )
    serve.add_argument("--result-dir", type=Path, default=Path("."), help="for --save-result")
    serve.add_argument(
        "--result-filename",
        default=None,
        help="for --save-result (default: openai-<rate>qps-<model>-<date>.json)",
    )
    add_workload_arguments(serve)

    sweep = commands.add_parser(
        "pd-sweep",
        help="compare P:D cluster shapes over request rates",
        description="Start a local cluster per shape (`baton up`), run the workload at "
        "each rate, and write report.md, PNG plots and results.json.",
    )
    sweep.add_argument(
        "--shapes",
        type=_shapes,
        default="1P1D,1P2D,2P1D,2P2D,agg2,agg4",
        help="comma-separated: <N>P<M>D (disaggregated) or agg<K> (aggregated)",
    )
    sweep.add_argument(
        "--rates", type=_rates, default="1,2,4", help="comma-separated request rates (req/s)"
    )
    sweep.add_argument(
        "--model",
        default=None,
        help="model folder for `baton up` (default: its built-in tiny model)",
    )
    sweep.add_argument("--out-dir", type=Path, default=Path("pd-sweep-results"))
    sweep.add_argument(
        "--launcher-cmd",
        default=None,
        help="replace `baton up ...` by this command; placeholders: {port} {host} "
        "{prefill} {decode} {workers} {shape} {model}",
    )
    sweep.add_argument(
        "--up-args",
        default="",
        help='more `baton up` arguments, e.g. "--device cuda --gpus 0,1,2,3"',
    )
    sweep.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds to wait until GET /health answers 200 with every expected worker joined",
    )
    sweep.add_argument(
        "--stop-grace",
        type=float,
        default=20.0,
        help="seconds between SIGTERM and SIGKILL when stopping a cluster",
    )
    add_workload_arguments(sweep)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What is sent and how it is judged: shared by `serve` and `pd-sweep`."""
    defaults = BenchConfig()
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default=defaults.endpoint)
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument(
        "--burstiness",
        type=float,
        default=defaults.burstiness,
        help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (the clock starts when a slot frees)",
    )
    parser.add_argument(
        "--num-requests",
        "--num-prompts",
        dest="num_requests",
        type=int,
        default=None,
        help="measured requests (default 100 unless --duration is given)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="model folder whose tokenizer counts prompt lengths (default: the folder the "
        "server names as the model's root in /v1/models)",
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds during which requests are sent"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="extra requests sent first and left out of the statistics",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", choices=DATASETS, default=defaults.dataset)
    parser.add_argument("--dataset-path", default=None, help="jsonl / trace file")
    parser.add_argument(
        "--input-len",
        type=int,
        default=defaults.input_len,
        help="prompt tokens (shared-prefix: tokens after the shared prefix)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=defaults.output_len,
        help="max_tokens of synthetic requests",
    )
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=defaults.range_ratio,
        help="lengths drawn uniformly from len*[1-r, 1+r]",
    )
    parser.add_argument(
        "--num-groups",
        type=int,
        default=defaults.num_groups,
        help="shared-prefix: number of distinct shared system prompts",
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=defaults.prefix_len,
        help="shared-prefix: tokens in each shared system prompt",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=defaults.time_scale,
        help="trace: multiply recorded gaps (0.5 replays twice as fast)",
    )
    parser.add_argument(
        "--slo", type=_slo, default={}, help="goodput limits, e.g. ttft=200ms,tpot=50ms,e2e=2s"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=defaults.request_timeout_s,
        help="seconds before one request counts as failed",
    )
    parser.add_argument(
        "--wait-for-workers",
        type=float,
        default=defaults.cluster_wait_s,
        help="seconds a cluster whose /health expects more workers than have joined gets "
        "for them; then the run is refused",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")


def config_from_args(args: argparse.Namespace, **overrides: object) -> BenchConfig:
    """The BenchConfig the flags describe; `overrides` set fields the flags do not have."""
    fields: dict[str, object] = dict(
        base_url=getattr(args, "base_url", BenchConfig.base_url),
        endpoint=args.endpoint,
        model=getattr(args, "model", None),
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        request_rate=getattr(args, "request_rate", math.inf),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_requests=args.num_requests,
        duration_s=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_groups=args.num_groups,
        prefix_len=args.prefix_len,
        time_scale=args.time_scale,
        slo=args.slo,
        request_timeout_s=args.timeout,
        cluster_wait_s=args.wait_for_workers,
        progress=not args.no_progress and sys.stdout.isatty(),
    )
    fields.update(overrides)
    return BenchConfig(**fields)  # type: ignore[arg-type]


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
    try:
        result = asyncio.run(run_benchmark(config, stop_on_signals=True))
    except BenchError as e:
        console.print(f"[red]bench serve:[/] {e}")
        return 1
    print_result(result, console)
    if result.stopped:
        console.print(f"[yellow]{result.stopped}:[/] the results cover the requests it sent")
    targets = [args.out] if args.out is not None else []
    if args.save_result:
        targets.append(args.result_dir / (args.result_filename or _result_name(result)))
    for target in targets:
        data = {"command": _command_line(), **result.to_dict()}
        console.print(f"results written to {write_json(data, target)}")
    return 0 if result.summary.completed > 0 and not result.partial else 1


def _run_sweep(args: argparse.Namespace, console: Console) -> int:
    from baton.benchmarks.pd_sweep import SweepConfig, run_sweep

    sweep = SweepConfig(
        shapes=args.shapes,
        rates=args.rates,
        bench=config_from_args(args, model=None, request_rate=args.rates[0]),
        model_dir=args.model,
        out_dir=args.out_dir,
        launcher_cmd=args.launcher_cmd,
        up_args=tuple(shlex.split(args.up_args)),
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
        command_line=_command_line(),
    )
    points = run_sweep(sweep, console)
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


def _slo(text: str) -> dict[str, float]:
    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"rates: {e}") from e
    if not rates or not all(0 < r < math.inf for r in rates):
        raise argparse.ArgumentTypeError("rates must be finite numbers > 0, e.g. 1,2,4")
    return rates


def _shapes(text: str) -> list[Shape]:
    from baton.benchmarks.pd_sweep import parse_shape

    try:
        return [parse_shape(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
