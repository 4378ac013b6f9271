"""Role flips under load (issue 41): a 1P3D cluster serves open-loop load while one decode
worker becomes a prefill worker (1P3D -> 2P2D) and, later, a decode worker again.

    python -m baton.benchmarks.role_flips --model DIR --up-args "--device cuda --gpus 0,1,2,3" \\
        --load 0.8 --duration 90 --flip-at 30,60 --out flips.json

The module starts the cluster (`baton up`, an admin key of its own making), measures its
capacity closed-loop when no `--request-rate` is given (rate = `--load` x capacity), then
runs `bench serve`'s open loop and, at each `--flip-at` second from the first request the
router sees, calls `POST /admin/workers/{id}/role`: first the busiest decode worker to
prefill, then the same worker back, alternately. It reads the router's `/metrics` before and
after the run, and reports failed requests, migrations by kind and reason, prefill tokens
recomputed because of a flip (`baton_router_migration_recomputed_tokens_total`), the longest
gap between tokens of a migrated stream from its migration to its end
(`baton_router_migration_stall_seconds`: the bucket it fell in), the cutovers alone (the old
worker's last output to the new one's first, `baton_router_migration_cutover_seconds`:
mean, p50, p99, largest), and the longest gap of any stream in flight during a flip (client
side), in a table and a JSON file (`migration_report.py`). The issue's targets: no failed
request, stall <= 200 ms, 0 recomputed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from baton.benchmarks import cli as bench_cli
from baton.benchmarks.client import fetch_model_card
from baton.benchmarks.config import BenchConfig
from baton.benchmarks.datasets import random_text
from baton.benchmarks.metrics import RequestRecord
from baton.benchmarks.migration_report import migration_report
from baton.benchmarks.pd_sweep import Cluster, free_port
from baton.benchmarks.report import write_json
from baton.benchmarks.serve import BenchResult, run_benchmark
from baton.benchmarks.sweep_config import (
    HOST,
    Rates,
    Words,
    launcher_command,
    parse_shape,
    parse_up_args,
)
from baton.common.options import add_options, option, option_values
from baton.services.top import Samples, parse

POLL_S = 0.05
WITNESS_LEAD_S = 0.3  # the witnesses start this long before the first flip: mid-answer at it
FLIP_MARGIN_S = 60.0  # the answer to a flip: past its drain, the switch and registration


def _seconds_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or any(not v >= 0 for v in values) or list(values) != sorted(values):
        raise argparse.ArgumentTypeError(f"expected ascending seconds, e.g. 30,60; got {text!r}")
    return Rates(values)


@dataclass(frozen=True)
class FlipConfig:
    shape: str = option("1P3D", "the cluster's shape (P and D workers)")
    flip_at: tuple[float, ...] = option(
        Rates((30.0, 60.0)),
        "seconds from the load's start at which a decode worker turns prefill, then back",
        parse=_seconds_list,
    )
    request_rate: float | None = option(
        None, "requests/s of the load (default: --load x the capacity it measures first)"
    )
    load: float = option(0.8, "the load's rate, as a share of the measured capacity")
    capacity_s: float = option(
        30.0, "seconds of the closed-loop capacity run (without --request-rate)"
    )
    capacity_concurrency: int = option(256, "requests in flight during the capacity run")
    drain_timeout_s: float = option(60.0, "seconds a flip's drain may take", flag="--drain-timeout")
    witnesses: int = option(
        8, "greedy requests started just before the first flip, checked against a quiet rerun"
    )
    witness_tokens: int = option(128, "tokens each witness generates")
    model_dir: str | None = option(
        None, "model folder (default: baton's tiny model)", flag="--model"
    )
    up_args: tuple[str, ...] = option(Words(), "more `baton up` arguments", parse=parse_up_args)
    out: Path = option(Path("role_flips.json"), "results JSON")
    log_dir: Path = option(Path("role_flips_logs"), "each cluster process's log")
    startup_timeout_s: float = option(
        300.0, "seconds for the cluster to start", flag="--startup-timeout"
    )


DEFAULT_DURATION_S = 90.0  # of load, when neither --duration nor --num-requests is given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, FlipConfig)
    add_options(parser, BenchConfig, exclude=("base_url", "model", "request_rate"))


@dataclass
class Witnesses:
    """Greedy requests started just before the first flip (so that some run on the worker
    that changes role and move), answered again once the cluster is quiet: a migrated
    stream's answer must not change. On a GPU a batch-dependent rounding can also change a
    greedy answer (random weights leave near-ties), so the same prompts also run as a
    control under the same load, away from any flip: differences the control shows too
    are the batches', not the migrations'. The CPU tests are the proof of exactness."""

    client: httpx.AsyncClient
    url: str
    model: str
    tokens: int
    prompts: list[str]
    tasks: list[asyncio.Task[str | None]] = dataclasses.field(default_factory=list)
    control: list[asyncio.Task[str | None]] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.answer(p)) for p in self.prompts]

    def start_control(self) -> None:
        self.control = [asyncio.create_task(self.answer(p)) for p in self.prompts]

    async def answer(self, prompt: str) -> str | None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        try:
            reply = await self.client.post(self.url + "/v1/completions", json=body, timeout=300)
        except httpx.HTTPError:
            return None
        return str(reply.json()["choices"][0]["text"]) if reply.status_code == 200 else None

    async def verdict(self) -> dict[str, Any]:
        during = await asyncio.gather(*self.tasks)
        control = await asyncio.gather(*self.control)
        quiet = await asyncio.gather(*(self.answer(p) for p in self.prompts))

        def differing(answers: list[str | None]) -> list[int]:
            pairs = zip(answers, quiet, strict=True) if answers else ()
            return [i for i, (a, b) in enumerate(pairs) if a != b or a is None]

        return {"witnesses": len(self.tasks), "witnesses_differing": differing(during),
                "control_witnesses": len(self.control),
                "control_differing": differing(control)}  # fmt: skip


def witness_prompts(count: int) -> list[str]:
    rng = np.random.default_rng(41)
    return [f"Witness {i}: {random_text(rng, 48)}" for i in range(count)]


async def _flipper(
    client: httpx.AsyncClient, url: str, key: str, config: FlipConfig, witnesses: Witnesses
) -> list[dict[str, Any]]:
    """Wait for the load's first request, then flip at each `flip_at` second (the witnesses
    start `WITNESS_LEAD_S` before the first)."""
    auth = {"Authorization": f"Bearer {key}"}
    while not any(w["load"]["in_flight"] for w in await _workers(client, url, auth)):
        await asyncio.sleep(POLL_S)
    start = time.monotonic()
    flips: list[dict[str, Any]] = []
    worker = ""
    for i, at in enumerate(config.flip_at):
        if i == 0:
            # the control: under the load, half-way to the first flip (done long before it)
            await asyncio.sleep(max(0.0, start + at / 2 - time.monotonic()))
            witnesses.start_control()
            await asyncio.sleep(max(0.0, start + at - WITNESS_LEAD_S - time.monotonic()))
            witnesses.start()
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        rows = await _workers(client, url, auth)
        to = "prefill" if i % 2 == 0 else "decode"
        if to == "prefill":  # the busiest decode worker: the most requests move
            decode = [w for w in rows if w["role"] == "decode" and w["state"] == "serving"]
            worker = max(decode, key=lambda w: w["load"]["in_flight"])["worker_id"]
        began = time.monotonic() - start
        answer = await client.post(
            f"{url}/admin/workers/{worker}/role",
            json={"role": to, "drain_timeout_s": config.drain_timeout_s},
            headers=auth,
            timeout=config.drain_timeout_s + FLIP_MARGIN_S,
        )
        in_flight = next((w["load"]["in_flight"] for w in rows if w["worker_id"] == worker), 0)
        flips.append({
            "at_s": round(began, 2), "worker": worker, "to": to, "status": answer.status_code,
            "seconds": answer.json().get("seconds") if answer.status_code == 200 else None,
            "in_flight_before": in_flight, "answer": answer.json(),
            "ended_s": round(time.monotonic() - start, 2),
        })  # fmt: skip
    return flips


async def _workers(client: httpx.AsyncClient, url: str, auth: dict[str, str]) -> list[Any]:
    answer = await client.get(url + "/admin/workers", headers=auth)
    answer.raise_for_status()
    return list(answer.json()["workers"])


async def _metrics(client: httpx.AsyncClient, url: str) -> Samples:
    answer = await client.get(url + "/metrics")
    answer.raise_for_status()
    return parse(answer.text)


def gaps_during_flips(
    records: list[RequestRecord], flips: list[dict[str, Any]], slack_s: float = 1.0
) -> float | None:
    """The longest gap between two tokens of any request in flight during a flip (its
    scheduled time to its answer overlapping the flip, give or take `slack_s`, since the
    load's start is seen from the router)."""
    longest = None
    for r in records:
        if not r.success or r.finished_s is None or not r.itl_s:
            continue
        for f in flips:
            if r.scheduled_s <= f["ended_s"] + slack_s and r.finished_s >= f["at_s"] - slack_s:
                gap = max(r.itl_s)
                longest = gap if longest is None else max(longest, gap)
    return longest


async def _measure(config: FlipConfig, bench: BenchConfig, url: str, key: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        capacity = None
        if config.request_rate is None:
            probe = dataclasses.replace(
                bench, base_url=url, duration_s=config.capacity_s, request_rate=math.inf,
                max_concurrency=config.capacity_concurrency,
                num_requests=max(100, int(config.capacity_s * 60)), progress=False,
            )  # fmt: skip
            capacity = (await run_benchmark(probe)).summary.request_throughput
            bench = dataclasses.replace(bench, request_rate=round(config.load * capacity, 2))
        bench = dataclasses.replace(bench, base_url=url)
        model = (await fetch_model_card(client, url, None)).get("id", "")
        witnesses = Witnesses(client, url, str(model), config.witness_tokens,
                              witness_prompts(config.witnesses))  # fmt: skip
        before = await _metrics(client, url)
        result, flips = await asyncio.gather(
            run_benchmark(bench), _flipper(client, url, key, config, witnesses)
        )
        await asyncio.sleep(1.0)  # the last stall observations are made as streams end
        after = await _metrics(client, url)
        checked = await witnesses.verdict()
    return {"capacity": capacity, "result": result, "flips": flips,
            "migration": {**migration_report(before, after), **checked}}  # fmt: skip


def run(config: FlipConfig, bench: BenchConfig, console: Console) -> dict[str, Any]:
    shape = parse_shape(config.shape)
    port = free_port()
    key = secrets.token_hex(16)
    command = launcher_command(
        shape, port=port, model_dir=config.model_dir, extra=config.up_args, log_dir=config.log_dir
    )
    url = f"http://{HOST}:{port}"
    cluster = Cluster(command, config.log_dir / "up.log", url, stop_grace_s=20.0,
                      env={"BATON_ADMIN_API_KEY": key})  # fmt: skip
    with cluster:
        cluster.wait_healthy(config.startup_timeout_s)
        console.print(f"{shape.name} is up at {url}")
        measured = asyncio.run(_measure(config, bench, url, key))
    result: BenchResult = measured["result"]
    s = result.summary
    data = {
        "command": bench_cli._command_line(),
        "shape": shape.name,
        "capacity_req_s": measured["capacity"],
        "rate_req_s": result.config.request_rate,
        "completed": s.completed,
        "failed": s.failed,
        "error_samples": s.error_samples,
        "flips": measured["flips"],
        **measured["migration"],
        "gap_in_flight_at_flips_s": gaps_during_flips(result.records, measured["flips"]),
        "longest_gap_any_stream_s": s.itl.max if s.itl else None,
        "bench": result.to_dict(),
    }
    write_json(data, config.out)
    console.print(table(data))
    console.print(f"results written to {config.out}")
    return data


def table(data: dict[str, Any]) -> Table:
    t = Table(title=f"role flips under load: {data['shape']} at {data['rate_req_s']} req/s")
    t.add_column("what")
    t.add_column("value", justify="right")
    for f in data["flips"]:
        took = "refused" if f["seconds"] is None else f"{f['seconds']:.2f} s"
        t.add_row(f"flip at {f['at_s']:.0f} s: {f['worker']} -> {f['to']}",
                  f"{f['status']}, {took}, {f['in_flight_before']} in flight")  # fmt: skip

    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"

    def cutovers(h: dict[str, Any]) -> str:
        bounds = (h["p50_at_most_s"], h["p99_at_most_s"], h["max_at_most_s"])
        return f"{h['count']}: {ms(h['mean_s'])}, " + ", ".join(ms(b) for b in bounds)

    witnessed = data["witnesses"] - len(data["witnesses_differing"])
    control = data.get("control_witnesses", 0)
    controlled = control - len(data.get("control_differing", []))

    def listed(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"

    rows = [
        ("requests completed / failed (target: 0)", f"{data['completed']} / {data['failed']}"),
        ("migrations (kind/reason)", listed(data["migrations"])),
        ("prefill tokens recomputed (target: 0)", str(data["recomputed_tokens"])),
        ("longest stall of a migrated stream (<= 200 ms)", "<= " + ms(data["stall_max_at_most_s"])),
        ("mean stall of a migrated stream", ms(data["stall_mean_s"])),
        ("cutovers: mean, p50, p99, max (buckets: <=)", cutovers(data["cutover"])),
        ("longest gap, a stream in flight at a flip", ms(data["gap_in_flight_at_flips_s"])),
        ("longest gap, any stream", ms(data["longest_gap_any_stream_s"])),
        ("role changes (role/outcome)", listed(data["role_changes"])),
        ("greedy witnesses equal to a quiet rerun", f"{witnessed} / {data['witnesses']}"),
        ("the same, the control (load, no flip)", f"{controlled} / {control}"),
    ]  # fmt: skip
    for what, value in rows:
        t.add_row(what, value)
    return t


def configs(argv: list[str] | None = None) -> tuple[FlipConfig, BenchConfig]:
    """The flips' settings and the load's, from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    bounded = args.duration is not None or args.num_requests is not None
    duration = args.duration if bounded else DEFAULT_DURATION_S
    config = FlipConfig(**option_values(FlipConfig, args))
    # without a rate, 1 req/s stands in until the capacity is measured (`_measure`)
    rate = config.request_rate or 1.0
    exclude = ("base_url", "model", "duration_s", "request_rate")
    bench = bench_cli.config_from_args(
        args, exclude=exclude, duration_s=duration, request_rate=rate
    )
    return config, bench


def main(argv: list[str] | None = None) -> int:
    config, bench = configs(argv)
    data = run(config, bench, Console())
    return 0 if data["failed"] == 0 and data["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
