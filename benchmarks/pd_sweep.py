"""`baton bench pd-sweep`: which P:D shape serves a workload best, rate by rate.

For each shape the sweep starts a local cluster as a subprocess in its own process
group, waits until GET /health answers 200 with every worker the router expects joined
(`baton up` tells the router how many), runs the workload at every rate with the
`serve` core, and stops the whole group (SIGTERM, then SIGKILL after a grace period).
A run during which a worker left is marked partial in the results and the report, and
left out of the best shape.
The cluster command line is built by `sweep_config.launcher_command` alone; `--launcher-cmd`
replaces it with a template (tests point it at the fake server).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType

import httpx
from rich.console import Console

from baton.benchmarks import run_plots
from baton.benchmarks.elastic_report import planner_decisions
from baton.benchmarks.migration_report import migration_report
from baton.benchmarks.presence import Reading
from baton.benchmarks.report import write_json
from baton.benchmarks.serve import BenchError, run_benchmark
from baton.benchmarks.sweep_config import HOST, Shape, SweepConfig, SweepPoint
from baton.benchmarks.sweep_report import write_sweep_outputs
from baton.services.top import Samples, parse

HEALTH_POLL_S = 0.25
LOG_TAIL_BYTES = 2000


class ClusterError(RuntimeError):
    """A cluster that would not start or become healthy."""


class Cluster:
    """One cluster subprocess and every process it starts (its own process group)."""

    def __init__(
        self,
        command: list[str],
        log_path: Path,
        base_url: str,
        stop_grace_s: float,
        env: dict[str, str] | None = None,
    ):
        self.command = command
        self.log_path = log_path
        self.base_url = base_url
        self.stop_grace_s = stop_grace_s
        self.env = env  # on top of this process's environment (secrets stay off the ps line)
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Cluster:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            try:
                self._proc = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() reaches every child
                    env=None if self.env is None else {**os.environ, **self.env},
                )
            except OSError as e:
                raise ClusterError(f"cannot start {shlex.join(self.command)}: {e}") from e
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def group(self) -> int | None:
        """The process group of every process of the cluster (None: not started)."""
        return None if self._proc is None else self._proc.pid

    def wait_healthy(self, timeout_s: float) -> Reading:
        """Wait until /health answers 200 with no expected worker missing; its answer."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        reading = Reading()
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ClusterError(
                        f"cluster exited with code {self._proc.returncode}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    reading = Reading.of(client.get(self.base_url + "/health"))
                    if reading.http_status == 200 and not reading.missing:
                        return reading
                time.sleep(HEALTH_POLL_S)
        raise ClusterError(
            f"not healthy after {timeout_s:g} s ({reading.describe()}):\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM the group; SIGKILL whatever is left after the grace period. Idempotent."""
        if self._proc is None:
            return
        group = self._proc.pid  # == the group id, thanks to start_new_session
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=self.stop_grace_s)
        # The leader may be gone while its children still shut down: give them the rest.
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(group, signal.SIGKILL)
        self._proc.wait()
        self._proc = None

    def log_tail(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
            return log.read().decode("utf-8", errors="replace")
        return ""


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_sweep(config: SweepConfig, console: Console | None = None) -> list[SweepPoint]:
    """Every shape at every rate; writes results.json, report.md and plots to out_dir."""
    console = console or Console()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    points: list[SweepPoint] = []
    paths: list[Path] = []
    with _sigterm_as_exit():
        for repeat in range(config.repeats):
            for shape in config.shapes:
                points += _sweep_shape(config, shape, console, repeat)
                # after every shape: a sweep stopped later keeps the report of what it measured
                paths = write_sweep_outputs(config, points)
    for path in paths:
        console.print(f"wrote {path}")
    return points


def _sweep_shape(
    config: SweepConfig, shape: Shape, console: Console, repeat: int = 0
) -> list[SweepPoint]:
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    command = config.command_for(shape, port, repeat)
    name = config.run_name(shape.name, repeat)
    console.print(f"[bold]{name}[/]: starting {shlex.join(command)}")
    points: list[SweepPoint] = []
    log_path = config.out_dir / "logs" / f"cluster-{name}.log"
    cluster = Cluster(command, log_path, base_url, config.stop_grace_s)
    started = time.monotonic()
    try:
        with cluster:
            up = cluster.wait_healthy(config.startup_timeout_s)
            ready_s = round(time.monotonic() - started, 1)
            console.print(f"[bold]{name}[/]: up in {ready_s:.0f} s, {up.describe()}")
            for rate in config.rates:
                points.append(_run_point(config, shape, rate, base_url, console, repeat))
                points[-1].ready_s = ready_s
    except ClusterError as e:
        console.print(f"[red]{name}: {e}[/]")
        done = {p.rate for p in points}
        points += [
            SweepPoint(shape.name, shape.num_workers, rate, error=str(e), repeat=repeat)
            for rate in config.rates
            if rate not in done
        ]
    return points


def _run_point(
    config: SweepConfig, shape: Shape, rate: float, base_url: str, console: Console, repeat: int
) -> SweepPoint:
    point = SweepPoint(shape.name, shape.num_workers, rate, repeat=repeat)
    name = config.run_name(shape.name, repeat)
    bench = config.point_config(base_url, rate)
    started = time.time()
    before = _router_metrics(base_url) if shape.planner else None
    try:
        result = asyncio.run(run_benchmark(bench))
    except BenchError as e:
        point.error = str(e)
        console.print(f"[red]{name} @ {config.at(rate)}: {e}[/]")
        return point
    point.summary = result.summary
    point.partial = result.partial
    point.phases = [{k: v for k, v in p.to_dict().items() if k != "summary"} for p in result.phases]
    # the router's /metrics as the run ended: kept beside its results (what the placement
    # read of each worker, its counts by kind), and a planner's migrations during it
    scraped = _router_metrics_text(base_url)
    if shape.planner:
        log = config.cluster_logs(shape, repeat) / "planner.log"
        point.planner = planner_decisions(log, started, time.time())
        flips = sum(bool(d["flip"]) for d in point.planner)
        console.print(f"  planner: {len(point.planner)} decisions, {flips} role flips")
        if before is not None and scraped is not None:
            point.migrations = migration_report(before, parse(scraped))
    path = config.out_dir / "runs" / f"{name}-rate{rate:g}.json"
    point.result_file = str(write_json(result.to_dict(), path).relative_to(config.out_dir))
    if scraped is not None:
        path.with_suffix(".router_metrics.txt").write_text(scraped)
    if run_plots.can_plot():  # each run's latency CDFs and throughput, as bench serve's
        title = f"({name} @ {config.at(rate)})"
        run_plots.write_run_plots(result.records, *run_plots.beside(path), title=title)
    s = result.summary
    console.print(
        f"  {name} @ {config.at(rate)}: {s.completed} ok, {s.failed} failed, "
        f"goodput {s.goodput:.2f} req/s ({point.goodput_per_worker:.2f} per worker)"
        + (f" [red]PARTIAL CLUSTER: {point.partial}[/]" if point.partial else "")
    )
    return point


def _router_metrics_text(base_url: str) -> str | None:
    """The router's /metrics now; None when it does not answer."""
    try:
        answer = httpx.get(base_url + "/metrics", timeout=10)
        answer.raise_for_status()
    except httpx.HTTPError:
        return None
    return answer.text


def _router_metrics(base_url: str) -> Samples | None:
    """The router's /metrics now, parsed (None, and a run without the migration figures,
    when it does not answer)."""
    text = _router_metrics_text(base_url)
    return parse(text) if text is not None else None


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit, so `finally` blocks stop the running cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
