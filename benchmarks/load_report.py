"""Summarize an overload run (`bench serve` JSON) the way an operator reads it: completed,
429 (overload answered), 5xx and other failures, the KV pages each worker still holds
once the load is gone (scraped from the workers' /metrics, found in `baton up`'s logs), and
the requests that completed only after stalling mid-stream (a gap between two tokens over
``--stall-s``: starved, not failed).

    python -m baton.benchmarks.load_report RUN.json --capacity C --rate R --log-dir DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path


def worker_metrics_texts(log_dir: Path) -> dict[str, str | None]:
    """{worker log name: its /metrics text, None where unreachable} for every worker that
    logged its HTTP address in `log_dir` (the `baton up --log-dir` folder)."""
    out: dict[str, str | None] = {}
    for log in sorted(log_dir.glob("*.log")):
        # the last one: a log kept from an earlier run (or a restarted worker) has several
        found = re.findall(r"BATON_WORKER_READY .*http=(\S+)", log.read_text(errors="replace"))
        if not found:
            continue
        try:
            with urllib.request.urlopen(f"http://{found[-1]}/metrics", timeout=5) as r:
                out[log.stem] = r.read().decode()
        except OSError as exc:
            out[log.stem] = None
            print(f"{log.stem}: /metrics unreachable: {exc}", file=sys.stderr)
    return out


def worker_metrics(log_dir: Path) -> dict[str, dict[str, float]]:
    """{worker log name: {gauge: value}} for every worker that logged its HTTP address."""
    out = {}
    for name, text in worker_metrics_texts(log_dir).items():
        if text is None:
            out[name] = {"unreachable": 1.0}
            continue
        gauges = {}
        for gauge in ("running", "queued", "pages_in_use"):
            m = re.search(rf"^baton_worker_{gauge} (\S+)$", text, re.M)
            if m:
                gauges[gauge] = float(m.group(1))
        out[name] = gauges
    return out


def classify(error: str | None) -> str:
    if error is None:
        return "completed"
    m = re.match(r"HTTP (\d+)", error)
    if m:
        code = int(m.group(1))
        return "429" if code == 429 else ("5xx" if code >= 500 else f"{code}")
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--capacity", type=float, required=True, help="measured req/s")
    ap.add_argument("--rate", type=float, required=True, help="offered req/s")
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--name", default="")
    ap.add_argument("--drain-s", type=float, default=60.0)
    ap.add_argument(
        "--stall-s", type=float, default=30.0, help="a gap between two tokens this long is a stall"
    )
    args = ap.parse_args(argv)
    run = json.loads(args.run.read_text())
    records = [r for r in run["requests"] if r.get("sent") and not r.get("warmup")]
    kinds = Counter(
        classify(None if r.get("success") else (r.get("error") or "?")) for r in records
    )
    # a request that stopped mid-stream for a long time (starved) completes all the same
    gaps = [max(r.get("itl_s") or [0.0]) for r in records if r.get("success")]
    longest = max(gaps, default=0.0)
    stalled = sum(g > args.stall_s for g in gaps)
    deadline = time.monotonic() + args.drain_s
    while True:  # held pages return once the last streams end
        metrics = worker_metrics(args.log_dir)
        if (
            all(m.get("pages_in_use", 1) == 0 for m in metrics.values())
            or time.monotonic() > deadline
        ):
            break
        time.sleep(1)
    held = {name: m.get("pages_in_use") for name, m in metrics.items()}
    errors = Counter((r.get("error") or "")[:80] for r in records if not r.get("success"))
    result = {
        "name": args.name,
        "capacity_rps": args.capacity,
        "offered_rps": args.rate,
        "requests": len(records),
        "by_kind": dict(kinds),
        "held_pages_after": held,
        "longest_token_gap_s": longest,
        "stalled": stalled,
        "stall_s": args.stall_s,
        "top_errors": errors.most_common(5),
        "summary": run["summary"],
    }
    args.run.with_suffix(".report.json").write_text(json.dumps(result, indent=2))
    print(
        f"| {args.name} | {args.capacity:.2f} | {args.rate:.2f} | {len(records)} | "
        f"{kinds['completed']} | {kinds['429']} | {kinds['5xx']} | "
        f"{sum(v for k, v in kinds.items() if k not in ('completed', '429', '5xx'))} | "
        f"{_pages(held)} | {longest:.1f} | {stalled} |"
    )
    return 0


def _pages(held: dict[str, float | None]) -> str:
    """`worker-0: 0, worker-1: 0`; unknown where a worker's metrics could not be read."""
    if not held:
        return "unknown (no worker metrics)"
    return ", ".join(f"{n}: {'unknown' if v is None else int(v)}" for n, v in held.items())


if __name__ == "__main__":
    sys.exit(main())
