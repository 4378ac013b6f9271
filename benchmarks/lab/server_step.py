"""A running server's decode step, read from its worker's counters while a burst decodes
(issue 38: the decode worker of 3P1D stepped at ~1.6x its memory floor under load, where
the engine alone at batch 128 was 1.18x; is the excess the server's or the engine's?).

    python -m baton.benchmarks.lab.server_step --base-url URL --log-dir DIR \
        --concurrency 200 --input-len 1330 --output-len 768 [--out server_step.json]

Against a cluster started with `baton up --log-dir DIR`: sends one burst of --concurrency
requests (`bench serve`, EOS ignored) and, while it runs, reads every worker's /metrics
every --interval s: engine steps, decode steps replayed from a CUDA graph, the running
batch. An interval in which every step was a decode graph's (no prompt ran) and the batch
held still is a steady decode interval: its step time is its seconds over its steps.
Prints the steady step time by batch (median of the intervals, and how many), the full
garbage collections in the scheduler process during the burst, and the bench's TPOT;
JSON with --out. Compare with `gpu_engine --sections decode` at the same
batch and context, on the same GPU, after the server stops (gpu_session.sh server_step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

_SERIES = {
    "steps": r"^baton_worker_steps_total (\S+)$",
    "decode_graph_steps": r'^baton_worker_graph_steps_total\{graph="decode"\} (\S+)$',
    "running": r"^baton_worker_running (\S+)$",
    "queued": r"^baton_worker_queued (\S+)$",
    "gc2_count": r'^baton_worker_gc_pause_seconds_count\{generation="2"\} (\S+)$',
    "gc2_seconds": r'^baton_worker_gc_pause_seconds_sum\{generation="2"\} (\S+)$',
}


def parse(text: str) -> dict[str, float]:
    """The series this benchmark reads from one /metrics text (absent ones left out)."""
    out = {}
    for name, pattern in _SERIES.items():
        m = re.search(pattern, text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def steady_intervals(samples: list[tuple[float, dict[str, float]]]) -> list[dict[str, float]]:
    """From (time, series) samples of one worker, in time order: every interval between two
    samples in which steps ran, all of them decode graph replays, with the same running
    batch at both ends and nothing queued. Each as {batch, steps, step_ms}."""
    out = []
    for (t0, a), (t1, b) in itertools.pairwise(samples):
        if not all(k in a and k in b for k in ("steps", "decode_graph_steps", "running")):
            continue
        steps = b["steps"] - a["steps"]
        decode = b["decode_graph_steps"] - a["decode_graph_steps"]
        if steps <= 0 or decode != steps or a["running"] != b["running"]:
            continue
        if a.get("queued", 0) or b.get("queued", 0):
            continue
        out.append({"batch": b["running"], "steps": steps, "step_ms": 1e3 * (t1 - t0) / steps})
    return out


def by_batch(intervals: list[dict[str, float]]) -> list[dict[str, Any]]:
    """The intervals grouped by batch: median step time, intervals and steps counted."""
    groups: dict[int, list[dict[str, float]]] = {}
    for i in intervals:
        groups.setdefault(int(i["batch"]), []).append(i)
    return [
        {
            "batch": batch,
            "step_ms": statistics.median(i["step_ms"] for i in group),
            "intervals": len(group),
            "steps": int(sum(i["steps"] for i in group)),
        }
        for batch, group in sorted(groups.items(), reverse=True)
    ]


def worker_urls(log_dir: Path) -> dict[str, str]:
    """{worker log name: its /metrics URL} for every worker `baton up` logged as ready."""
    out = {}
    for log in sorted(log_dir.glob("*.log")):
        found = re.findall(r"BATON_WORKER_READY .*http=(\S+)", log.read_text(errors="replace"))
        if found:
            out[log.stem] = f"http://{found[-1]}/metrics"
    return out


def sample_until(
    urls: dict[str, str], done: threading.Event, interval: float
) -> dict[str, list[tuple[float, dict[str, float]]]]:
    samples: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in urls}
    while not done.is_set():
        for name, url in urls.items():
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            samples[name].append((time.monotonic(), parse(text)))
        done.wait(interval)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument(
        "--log-dir", required=True, type=Path, help="the cluster's `baton up --log-dir`"
    )
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=1330)
    ap.add_argument("--output-len", type=int, default=768)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between reads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    urls = worker_urls(args.log_dir)
    if not urls:
        sys.exit(f"no worker logged BATON_WORKER_READY in {args.log_dir}")
    bench_out = Path(args.out or "server_step.json").with_suffix(".bench.json")
    n = str(args.concurrency)
    bench = [sys.executable, "-m", "baton.services.cli", "bench", "serve"]
    bench += ["--base-url", args.base_url, "--max-concurrency", n, "--num-requests", n]
    bench += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    bench += ["--ignore-eos", "--no-progress", "--timeout", "600", "--out", str(bench_out)]
    done = threading.Event()
    result: dict[str, Any] = {}
    sampler = threading.Thread(
        target=lambda: result.update(sample_until(urls, done, args.interval))
    )
    sampler.start()
    try:
        rc = subprocess.run(bench, stdout=subprocess.DEVNULL, check=False).returncode
    finally:
        done.set()
        sampler.join()
    summary = json.loads(bench_out.read_text())["summary"] if bench_out.exists() else {}
    workers: dict[str, dict[str, Any]] = {}
    for name, samples in result.items():
        workers[name] = {"by_batch": by_batch(steady_intervals(samples)), "samples": len(samples)}
        first, last = (samples[0][1], samples[-1][1]) if samples else ({}, {})
        for key in ("gc2_count", "gc2_seconds"):
            workers[name][key] = last.get(key, 0.0) - first.get(key, 0.0)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "bench_rc": rc}
    report |= {"bench": summary, "workers": workers}
    tpot = (summary.get("tpot") or {}).get("p50", float("nan"))
    print(f"bench exit {rc}; TPOT p50 {1e3 * tpot:.2f} ms")
    for name, w in workers.items():
        print(
            f"{name}: {w['samples']} reads; {w['gc2_count']:.0f} full garbage collections, "
            f"{1e3 * w['gc2_seconds']:.0f} ms in all; steady decode step by running batch"
        )
        for row in w["by_batch"][:8]:
            print(
                f"  batch {row['batch']:4d}: {row['step_ms']:7.2f} ms ({row['intervals']} intervals, {row['steps']} steps)"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
