"""What tracing every request costs a 1P1D cluster of the tiny model on this CPU (issue 44:
at most 2% of the throughput of `baton bench serve` at 80% of capacity).

    python -m baton.benchmarks.micro.tracing_overhead --rounds 6 \\
        --out benchmarks/results/tracing_overhead.json

Two clusters of one shape run side by side: A with tracing off, B tracing every request
(`--otlp-traces-sample-ratio 1.0`) to an OTLP/gRPC sink in this process that counts the
spans it receives. Only one is loaded at a time, by `baton bench serve` in a process of its
own. First each one's capacity: the requests/s it serves while offered more than it can
(`--capacity-rate` for `--capacity-duration` s, open loop); then load at 80% of A's
capacity. The arms alternate A B, B A, round after round, so that drift and the host's
other tenants hit both alike; the range over the rounds says how much of a difference is
noise. Beside bench serve's figures, each run's CPU time of the whole cluster (every
process under its launcher, from /proc) per request served, in all and for the router, P
and D (frontend and scheduler): on a host whose cores the cluster saturates, the sharpest
measure of what tracing costs the throughput. At 80% both arms serve what is offered
unless tracing pushes B past its capacity; their latencies show what it costs a request.
A busy-polling scheduler's CPU per request shrinks when the host is busier, so the
router's and the frontends' are the steadier figures. Before the clusters start,
tracing_cpu.py measures the CPU a traced request costs in tracing code alone, free of the
other tenants' noise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from baton.benchmarks.micro import tracing_cpu
from baton.benchmarks.micro.tracing_cpu import SpanSink
from baton.benchmarks.pd_sweep import Cluster, free_port

ARMS = ("off", "traced")
FIGURES = (  # (key in bench serve's JSON, column)
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("cpu_ms_per_request", "CPU ms/req"),
    ("router_cpu_ms_per_request", "  router"),
    ("prefill_cpu_ms_per_request", "  P frontend"),
    ("prefill_scheduler_cpu_ms_per_request", "  P scheduler"),
    ("decode_cpu_ms_per_request", "  D frontend"),
    ("decode_scheduler_cpu_ms_per_request", "  D scheduler"),
)


COMPONENTS = ("router", "prefill", "decode")  # the rest (launcher, bootstrap): "other"


def cpu_seconds_by_component(root: int) -> dict[str, float]:
    """User and system CPU seconds of `root` and every live process under it, by the
    cluster component each belongs to: the router, a worker's frontend (`prefill`), its
    scheduler process and the processes that one starts (`prefill_scheduler`)."""
    procs: dict[int, tuple[int, float, str]] = {}  # pid: ppid, CPU seconds, command line
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        procs[int(stat.parent.name)] = int(fields[1]), cpu, command

    def component(pid: int) -> str:
        below = ""
        while pid in procs and pid != root:
            words = procs[pid][2].split()
            for name in COMPONENTS:
                if name in words[3:5]:  # python -m baton.services.cli <name>
                    return name + below
            pid, below = procs[pid][0], "_scheduler"
        return "other"

    names = [f"{name}{part}" for name in COMPONENTS for part in ("", "_scheduler")]
    out = dict.fromkeys((*names, "other"), 0.0)
    for pid, (_, cpu, _) in procs.items():
        p = pid
        while p in procs and p != root:
            p = procs[p][0]
        if p == root:
            out[component(pid)] += cpu
    return out


def cluster_command(port: int, traced_to: str | None) -> list[str]:
    command = [sys.executable, "-m", "baton.services.cli", "up", "--port", str(port)]
    command += ["--prefill", "1", "--decode", "1"]
    if traced_to is not None:
        command += ["--otlp-traces-endpoint", traced_to, "--otlp-traces-sample-ratio", "1.0"]
    return command


def bench(
    base_url: str, group: int, args: argparse.Namespace, rate: float, duration: float, out: Path
) -> dict[str, Any]:
    """One `baton bench serve` run against the cluster of process group `group`: its
    results, and the cluster's CPU per request served."""
    command = [sys.executable, "-m", "baton.services.cli", "bench", "serve"]
    command += ["--base-url", base_url, "--dataset", "random", "--no-progress"]
    command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    command += ["--seed", str(args.seed), "--warmup", str(args.warmup), "--out", str(out)]
    command += ["--request-rate", f"{rate:.3f}", "--duration", f"{duration:g}"]
    before = cpu_seconds_by_component(group)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    after = cpu_seconds_by_component(group)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if result.get("failed"):
        raise RuntimeError(f"{result['failed']} requests failed: {out}")
    served = result["completed"] + args.warmup
    if served:  # a process that ended during the run would count negative: none does
        for name in after:
            result[f"{name}_cpu_ms_per_request"] = 1000 * (after[name] - before[name]) / served
        result["cpu_ms_per_request"] = 1000 * sum(after[n] - before[n] for n in after) / served
    return result


def alternate(
    clusters: dict[str, tuple[str, int]],
    args: argparse.Namespace,
    rate: float,
    duration: float,
    tmp: Path,
    label: str,
) -> dict[str, list[dict[str, Any]]]:
    """Each round runs the arms A B, then B A: the runs of each arm, in order."""
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for round_no in range(args.rounds):
        order = ARMS if round_no % 2 == 0 else ARMS[::-1]
        for arm in order:
            url, group = clusters[arm]
            out = tmp / f"{label}-{round_no}-{arm}.json"
            result = bench(url, group, args, rate, duration, out)
            runs[arm].append({k: result.get(k) for k, _ in FIGURES})
            figures = "  ".join(f"{c} {result.get(k) or 0:.2f}" for k, c in FIGURES)
            print(f"  {label} round {round_no} {arm:6}: {figures}", flush=True)
    return runs


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per figure: each arm's mean and range, and B against A: the ratio of the means,
    the median of the per-round ratios (robust to a run the host's other load spoiled),
    and their range."""
    out: dict[str, Any] = {}
    for key, _ in FIGURES:
        off = [r[key] for r in runs["off"] if r[key] is not None]
        traced = [r[key] for r in runs["traced"] if r[key] is not None]
        if not off or not traced:
            continue
        ratios = [t / o - 1.0 for o, t in zip(off, traced, strict=False) if o]
        out[key] = {
            "off": {"mean": statistics.fmean(off), "min": min(off), "max": max(off)},
            "traced": {"mean": statistics.fmean(traced), "min": min(traced), "max": max(traced)},
            "change": statistics.fmean(traced) / statistics.fmean(off) - 1.0,
            "change_median": statistics.median(ratios) if ratios else None,
            "change_min": min(ratios) if ratios else None,
            "change_max": max(ratios) if ratios else None,
        }
    return out


def table(title: str, compared: dict[str, Any]) -> str:
    head = "traced/off - 1: means, median [range] of rounds"
    lines = [f"{title}", f"{'':14} {'off':>18} {'traced':>18}   {head}"]
    for key, column in FIGURES:
        c = compared.get(key)
        if c is None:
            continue
        arms = [f"{c[a]['mean']:8.2f} [{c[a]['min']:.1f}, {c[a]['max']:.1f}]" for a in ARMS]
        change = f"{c['change']:+7.1%}, {c['change_median']:+7.1%}"
        change += f" [{c['change_min']:+.1%}, {c['change_max']:+.1%}]"
        lines.append(f"{column:14} {arms[0]:>18} {arms[1]:>18}   {change}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="A B (then B A) pairs per phase")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each 80%% run")
    parser.add_argument(
        "--capacity-rate", type=float, default=40.0, help="requests/s offered to find capacity"
    )
    parser.add_argument("--capacity-duration", type=float, default=10.0)
    parser.add_argument(
        "--rate", type=float, help="load at this many requests/s (no capacity runs)"
    )
    parser.add_argument("--load", type=float, default=0.8, help="share of A's capacity offered")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--in-process-requests", type=int, default=2000, help="tracing_cpu's requests a round"
    )
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    args = parser.parse_args()

    in_process = tracing_cpu.measure(args.in_process_requests, rounds=3)
    print(tracing_cpu.report(in_process), flush=True)

    sink = SpanSink()
    tmp = Path(tempfile.mkdtemp(prefix="tracing-overhead-"))
    ports = {arm: free_port() for arm in ARMS}
    urls = {arm: f"http://127.0.0.1:{ports[arm]}" for arm in ARMS}
    commands = {
        arm: cluster_command(ports[arm], sink.endpoint if arm == "traced" else None) for arm in ARMS
    }
    try:
        with contextlib.ExitStack() as stack:
            running = {}
            for arm in ARMS:
                cluster = Cluster(commands[arm], tmp / f"cluster-{arm}.log", urls[arm], 10.0)
                stack.enter_context(cluster).wait_healthy(180)
                assert cluster.group is not None
                running[arm] = urls[arm], cluster.group
            print(f"clusters up; OTLP sink at {sink.endpoint}; logs in {tmp}", flush=True)
            capacity_runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            capacity, rate = None, args.rate
            if rate is None:
                capacity_runs = alternate(
                    running, args, args.capacity_rate, args.capacity_duration, tmp, "capacity"
                )
                capacity = statistics.fmean(r["request_throughput"] for r in capacity_runs["off"])
                rate = args.load * capacity
                print(f"capacity (off) {capacity:.2f} req/s: loading at {rate:.2f} req/s")
            spans_before = sink.spans
            load_runs = alternate(running, args, rate, args.duration, tmp, "load")
            spans_at_load = sink.spans - spans_before
    finally:
        sink.stop()

    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(shared with other work), {platform.platform()}",
        "command": shlex.join(["python", "-m", __spec__.name, *sys.argv[1:]]),
        "clusters": {arm: shlex.join(commands[arm]) for arm in ARMS},
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "capacity_req_s": capacity,
        "load_req_s": rate,
        "spans_received_at_load": spans_at_load,
        "in_process": in_process,
        "capacity": {"runs": capacity_runs, "compared": compare(capacity_runs)},
        "load": {"runs": load_runs, "compared": compare(load_runs)},
    }
    print("\n" + report(results))
    if args.out:
        write(results, args.out)


def report(results: dict[str, Any]) -> str:
    settings = results["settings"]
    return "\n\n".join(
        [
            table(
                f"capacity (offered {settings['capacity_rate']:g} req/s)",
                results["capacity"]["compared"],
            ),
            table(f"load of {results['load_req_s']:.2f} req/s", results["load"]["compared"]),
            f"spans the sink received during the load runs: {results['spans_received_at_load']}",
            tracing_cpu.report(results["in_process"]),
        ]
    )


def write(results: dict[str, Any], out: Path) -> None:
    """`results` as JSON at `out`, and its tables beside it (`.md`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    header = f"# Tracing's cost\n\n{results['date']}, {results['device']}\n\n"
    header += f"`{results['command']}`\n\nmean [min, max] over "
    header += f"{results['settings']['rounds']} runs per arm\n"
    out.with_suffix(".md").write_text(f"{header}\n```\n{report(results)}\n```\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
