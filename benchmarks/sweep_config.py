"""Settings of one `baton bench pd-sweep`, and what each of its runs leaves: the cluster
shapes, the command that starts one, the workload, and `SweepPoint`, one (shape, rate).

`pd_sweep` runs a sweep and `sweep_report` writes it up; both read these types, neither
imports the other's back.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from baton.benchmarks.config import TRACE_DATASETS, BenchConfig, BenchConfigError
from baton.benchmarks.metrics import Summary
from baton.benchmarks.phases import scaled
from baton.common.options import option
from baton.services.router.placement import PLACEMENT_NAMES

HOST = "127.0.0.1"  # where the sweep's clusters serve

_DISAGG = re.compile(r"^(\d+)P(\d+)D(\+planner)?(?:@([a-z-]+))?$", re.IGNORECASE)
_AGG = re.compile(r"^agg(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Shape:
    """A cluster layout: `prefill` + `decode` workers, or `workers` aggregated ones."""

    name: str
    prefill: int = 0
    decode: int = 0
    workers: int = 0
    planner: bool = False  # `baton up --planner`: P:D is where it starts, the planner moves it
    placement: str = ""  # the router's --placement for this shape ("": --up-args' or the default)

    @property
    def aggregated(self) -> bool:
        return self.workers > 0

    @property
    def num_workers(self) -> int:
        return self.workers if self.aggregated else self.prefill + self.decode


def parse_shape(text: str) -> Shape:
    """`"1P2D"` -> 1 prefill + 2 decode workers; `"agg4"` -> 4 aggregated workers;
    `"1P3D+planner"` -> 1P3D to start with, whose roles the planner changes; `"1P1D@cost"`
    -> 1P1D whose router places by `--placement cost` (one sweep, placements side by side)."""
    name = text.strip()
    if match := _DISAGG.match(name):
        prefill, decode, planner = int(match[1]), int(match[2]), bool(match[3])
        placement = (match[4] or "").lower()
        if placement and placement not in PLACEMENT_NAMES:
            raise ValueError(
                f"shape {text!r}: placement {placement!r} is not one of "
                f"{', '.join(PLACEMENT_NAMES)}"
            )
        if prefill >= 1 and decode >= 1:
            name = f"{prefill}P{decode}D" + ("+planner" if planner else "")
            name += f"@{placement}" if placement else ""
            return Shape(name, prefill=prefill, decode=decode, planner=planner, placement=placement)
    elif (match := _AGG.match(name)) and int(match[1]) >= 1:
        return Shape(f"agg{int(match[1])}", workers=int(match[1]))
    raise ValueError(
        f"shape {text!r}: expected <N>P<M>D[+planner][@placement] (N, M >= 1) or agg<K> (K >= 1)"
    )


class Shapes(tuple[Shape, ...]):
    """Shapes that print as `--shapes` spells them (`1P1D,agg2`), in `--help` too."""

    def __str__(self) -> str:
        return ",".join(shape.name for shape in self)


class Rates(tuple[float, ...]):
    """Request rates that print as `--rates` spells them (`1,2,4`)."""

    def __str__(self) -> str:
        return ",".join(f"{rate:g}" for rate in self)


def parse_shapes(text: str) -> Shapes:
    try:
        return Shapes(parse_shape(part) for part in text.split(",") if part.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse_rates(text: str) -> Rates:
    try:
        rates = Rates(float(part) for part in text.split(",") if part.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"rates: {e}") from e
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError("rates must be finite numbers > 0, e.g. 1,2,4")
    return rates


class Words(tuple[str, ...]):
    """Command-line words that print as a shell would read them (`--help`: none when empty)."""

    def __str__(self) -> str:
        return shlex.join(self) or "none"


def parse_up_args(text: str) -> Words:
    return Words(shlex.split(text))


def launcher_command(
    shape: Shape,
    *,
    port: int,
    model_dir: str | None,
    extra: Sequence[str] = (),
    log_dir: Path | None = None,
) -> list[str]:
    """THE command line that starts a local cluster of `shape` serving HTTP on `port`;
    `extra` goes to `baton up` unchanged (device, backend, --gpus...). With `log_dir`,
    each process logs to its own file there (the planner's decisions: planner.log)."""
    command = [sys.executable, "-m", "baton.services.cli", "up", "--port", str(port)]
    if shape.aggregated:
        command += ["--workers", str(shape.workers)]
    else:
        command += ["--prefill", str(shape.prefill), "--decode", str(shape.decode)]
    if shape.planner:
        command.append("--planner")
    if log_dir is not None:
        command += ["--log-dir", str(log_dir)]
    if model_dir:  # without --model, `baton up` serves its built-in tiny model
        command += ["--model", model_dir]
    # the shape's placement last: it wins over one in `extra` (argparse keeps the last)
    placement = ["--placement", shape.placement] if shape.placement else []
    return [*command, *extra, *placement]


def template_command(template: str, shape: Shape, *, port: int, model_dir: str | None) -> list[str]:
    """A `--launcher-cmd` template filled in: {port} {prefill} {decode} {workers} {shape} {model}
    {placement} (SweepConfig refuses a placed shape whose template has none)."""
    values = {
        "port": port,
        "host": HOST,
        "prefill": shape.prefill,
        "decode": shape.decode,
        "workers": shape.num_workers,
        "shape": shape.name,
        "model": model_dir or "",
        "placement": shape.placement,
    }
    return [token.format(**values) for token in shlex.split(template)]


# The workload's fields a sweep sets itself, per point: no flags of `pd-sweep`.
SWEPT = ("base_url", "model", "request_rate")


@dataclass(frozen=True)
class SweepConfig:
    shapes: Sequence[Shape] = option(
        parse_shapes("1P1D,1P2D,2P1D,2P2D,agg2,agg4"),
        "comma-separated: <N>P<M>D (disaggregated) or agg<K> (aggregated); <N>P<M>D+planner "
        "starts so and `baton up --planner` changes roles (its knobs: BATON_WINDOW, ...); "
        "<N>P<M>D@PLACEMENT sets the router's --placement for that shape (1P1D@cost)",
        parse=parse_shapes,
    )
    rates: Sequence[float] = option(
        parse_rates("1,2,4"),
        "comma-separated request rates (req/s); with a trace dataset, how many times its "
        "recorded speed it is replayed at (time scale = --time-scale / rate)",
        parse=parse_rates,
    )
    # the workload; base_url and request_rate are set per point
    bench: BenchConfig = field(default_factory=BenchConfig)
    out_dir: Path = option(Path("pd-sweep-results"), "where the report and runs go")
    model_dir: str | None = option(
        None, "model folder for `baton up` (default: its built-in tiny model)", flag="--model"
    )
    launcher_cmd: str | None = option(
        None,
        "replace `baton up ...` by this command; placeholders: {port} {host} "
        "{prefill} {decode} {workers} {shape} {model} {placement}",
    )
    up_args: tuple[str, ...] = option(
        Words(),
        'more `baton up` arguments, e.g. "--device cuda --gpus 0,1,2,3"',
        parse=parse_up_args,
    )
    startup_timeout_s: float = option(
        300.0,
        "seconds to wait until GET /health answers 200 with every expected worker joined",
        flag="--startup-timeout",
    )
    stop_grace_s: float = option(
        20.0, "seconds between SIGTERM and SIGKILL when stopping a cluster", flag="--stop-grace"
    )
    repeats: int = option(
        1,
        "runs of every shape at every rate, each repeat on fresh clusters, the shapes taken "
        "in turn (A B A B: a drift of the machine falls on all of them); the report ranks "
        "shapes by each point's median and gives its range",
    )
    command_line: str = ""  # recorded in the report

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise BenchConfigError(f"--repeats must be >= 1, got {self.repeats}")
        placed = [shape.name for shape in self.shapes if shape.placement]
        if placed and self.launcher_cmd and "{placement}" not in self.launcher_cmd:
            raise BenchConfigError(
                f"shapes {', '.join(placed)} name a placement, and --launcher-cmd has no "
                "{placement} to pass it on"
            )

    @property
    def replays_trace(self) -> bool:
        """A trace's requests come at its recorded times: a rate speeds the trace up."""
        return self.bench.dataset in TRACE_DATASETS

    def at(self, rate: float) -> str:
        """A point's load in words: "4 req/s", "trace x4" or "phases x4"."""
        if self.replays_trace or self.bench.phases:
            return f"{'trace' if self.replays_trace else 'phases'} x{rate:g}"
        return f"{rate:g} req/s"

    @property
    def rate_axis(self) -> str:
        if self.bench.phases:
            return "phases' rates (x given)"
        return "trace speed-up (x recorded)" if self.replays_trace else "request rate (req/s)"

    def point_config(self, base_url: str, rate: float) -> BenchConfig:
        """The workload of the run at `rate`. Each rate gets its own seed, so that its
        prompts miss the prefix cache the runs before it left on the same cluster."""
        seed = self.bench.seed + list(self.rates).index(rate)
        if self.bench.phases:
            phases = scaled(self.bench.phases, rate)
            return replace(self.bench, base_url=base_url, seed=seed, phases=phases)
        if self.replays_trace:
            time_scale = self.bench.time_scale / rate
            return replace(self.bench, base_url=base_url, seed=seed, time_scale=time_scale)
        return replace(self.bench, base_url=base_url, seed=seed, request_rate=rate)

    def command_for(self, shape: Shape, port: int, repeat: int = 0) -> list[str]:
        if self.launcher_cmd:
            return template_command(self.launcher_cmd, shape, port=port, model_dir=self.model_dir)
        logs = self.cluster_logs(shape, repeat) if shape.planner else None
        return launcher_command(
            shape, port=port, model_dir=self.model_dir, extra=self.up_args, log_dir=logs
        )

    def cluster_logs(self, shape: Shape, repeat: int = 0) -> Path:
        """Where a cluster that logs per process writes (a planner's: planner.log)."""
        return self.out_dir / "logs" / self.run_name(shape.name, repeat)

    def run_name(self, shape: str, repeat: int) -> str:
        """How a shape's cluster and runs are named in files: `1P1D`, or `1P1D-r2` for
        the second repeat of a sweep that repeats."""
        return f"{shape}-r{repeat + 1}" if self.repeats > 1 else shape


@dataclass
class SweepPoint:
    """One (shape, rate) run; `summary` is None when it could not run (see `error`)."""

    shape: str
    workers: int
    rate: float
    summary: Summary | None = None
    error: str | None = None
    result_file: str | None = None
    partial: str | None = None  # why the run measured fewer workers than the shape has
    ready_s: float | None = None  # from `baton up` to every worker joined (the shape's start)
    phases: list[dict[str, object]] | None = None  # a --phases run's results by phase
    planner: list[dict[str, object]] | None = None  # the planner's decisions during the run
    migrations: dict[str, Any] | None = None  # planner runs: `migration_report.py`'s
    repeat: int = 0  # which of the sweep's `repeats` (from 0)

    @property
    def goodput_per_worker(self) -> float | None:
        return None if self.summary is None else self.summary.goodput / self.workers
