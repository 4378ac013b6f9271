"""Side by side: a cluster with the KV cache's host-memory tier and one without it, after
the same replay (`gpu_session.sh host_tier`, issue 43's second target).

    python -m baton.benchmarks.host_tier_report scrape LOG_DIR OUT.json
    python -m baton.benchmarks.host_tier_report table NAME=DIR NAME=DIR --pool TOKENS [--out F]

`scrape` sums the counters of every worker that logged its HTTP address in LOG_DIR (the
`baton up --log-dir` folder) into a JSON object. `table` reads each DIR's `bench.json`
(`bench serve --out`), `metrics_before.json` and `metrics_after.json` (two scrapes around
the replay) and prints one column a run: TTFT, prefill tokens computed, the hit ratio of
each tier (GPU hits are the prefix hits not loaded from the host), bytes moved each way,
the time steps waited for those copies, and the window's working set against the pool.
Where the first run has the tier, the last line judges the issue's targets against the
second (TTFT p50 >= 2x better, prefill tokens computed >= 40% fewer); the same table
compares any two replays (`gpu_session.sh chunking`: prompt chunking against none).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from baton.benchmarks.load_report import worker_metrics_texts

# the workers' counters this report reads (`services/worker/metrics.py`)
SERIES = {
    "queries": "baton_worker_prefix_cache_queries_total",
    "hits": "baton_worker_prefix_cache_hits_total",
    "host_hits": "baton_worker_host_kv_hit_tokens_total",
    "to_host": 'baton_worker_host_kv_moved_bytes_total{direction="to_host"}',
    "to_device": 'baton_worker_host_kv_moved_bytes_total{direction="to_device"}',
    "stall_s": "baton_worker_host_kv_load_stall_seconds_total",
    "dropped": "baton_worker_host_kv_dropped_pages_total",
    "host_pages_used": "baton_worker_host_kv_pages_used",
    "host_pages": "baton_worker_host_kv_pages_capacity",
    "retracted": "baton_worker_retracted",
}


def counters(text: str) -> dict[str, float]:
    """The `SERIES` found in one worker's /metrics text (absent ones are left out)."""
    out = {}
    for key, series in SERIES.items():
        m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        if m:
            out[key] = float(m.group(1))
    return out


def scrape(log_dir: Path) -> dict[str, float]:
    """`SERIES` summed over the workers of a cluster; `unreachable`: workers not read."""
    total: dict[str, float] = {"workers": 0, "unreachable": 0}
    for text in worker_metrics_texts(log_dir).values():
        if text is None:
            total["unreachable"] += 1
            continue
        total["workers"] += 1
        for key, value in counters(text).items():
            total[key] = total.get(key, 0.0) + value
    return total


def run_figures(run_dir: Path, pool_tokens: int) -> dict[str, Any]:
    """One run's figures: the client's (bench.json) and the workers' growth over it."""
    bench = json.loads((run_dir / "bench.json").read_text())
    before = json.loads((run_dir / "metrics_before.json").read_text())
    after = json.loads((run_dir / "metrics_after.json").read_text())

    def grown(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    summary = bench["summary"]
    ttft = summary.get("ttft") or {}
    tpot, itl = summary.get("tpot") or {}, summary.get("itl") or {}
    ingress = (summary.get("server_timings") or {}).get("ingress") or {}
    nan = float("nan")
    queries, hits, host_hits = grown("queries"), grown("hits"), grown("host_hits")
    prompt_tokens = sum(r.get("expected_input_len") or 0 for r in bench.get("requests", []))
    reuse = bench.get("trace_prefix_reuse")
    working_set = prompt_tokens * (1 - reuse) if reuse is not None else None
    return {
        "requests": summary["measured"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "ttft_p50_ms": ttft.get("p50", nan) * 1e3,
        "ttft_p99_ms": ttft.get("p99", nan) * 1e3,
        "tpot_p50_ms": tpot.get("p50", nan) * 1e3,
        "tpot_p90_ms": tpot.get("p90", nan) * 1e3,
        "itl_p99_ms": itl.get("p99", nan) * 1e3,
        "ingress_p50_ms": ingress.get("p50", nan) * 1e3,
        "ingress_p90_ms": ingress.get("p90", nan) * 1e3,
        "prompt_tokens_admitted": queries,
        "prefill_tokens_computed": queries - hits,
        "gpu_hit_ratio": (hits - host_hits) / queries if queries else None,
        "host_hit_ratio": host_hits / queries if queries else None,
        "reusable_share": reuse,
        "working_set_tokens": working_set,
        "working_set_x_pool": working_set / pool_tokens if working_set is not None else None,
        "gib_to_host": grown("to_host") / 2**30,
        "gib_to_device": grown("to_device") / 2**30,
        "copy_wait_s": grown("stall_s"),
        "host_pages_dropped": grown("dropped"),
        "host_pages_used": after.get("host_pages_used"),
        "host_pages": after.get("host_pages"),
        "retracted": grown("retracted"),
        "workers_unreachable": after.get("unreachable", 0) + before.get("unreachable", 0),
    }


ROWS = [
    ("requests (completed / failed)", lambda f: f"{f['completed']} / {f['failed']}"),
    ("TTFT p50 ms", lambda f: f"{f['ttft_p50_ms']:,.0f}"),
    ("TTFT p99 ms", lambda f: f"{f['ttft_p99_ms']:,.0f}"),
    ("TPOT p50 / p90 ms", lambda f: f"{f['tpot_p50_ms']:.1f} / {f['tpot_p90_ms']:.1f}"),
    ("ITL p99 ms", lambda f: f"{f['itl_p99_ms']:,.0f}"),
    ("ingress p50 / p90 ms (got → scheduled)", lambda f: _pair(f, "ingress")),
    ("prompt tokens admitted", lambda f: f"{f['prompt_tokens_admitted']:,.0f}"),
    ("prefill tokens computed", lambda f: f"{f['prefill_tokens_computed']:,.0f}"),
    ("hit ratio, GPU tier", lambda f: _share(f["gpu_hit_ratio"])),
    ("hit ratio, host tier", lambda f: _share(f["host_hit_ratio"])),
    ("reusable in the window (unbounded cache)", lambda f: _share(f["reusable_share"])),
    ("working set tokens (x pool)", lambda f: _working_set(f)),
    ("GiB GPU -> host", lambda f: f"{f['gib_to_host']:.2f}"),
    ("GiB host -> GPU", lambda f: f"{f['gib_to_device']:.2f}"),
    ("copy time steps waited for, s", lambda f: f"{f['copy_wait_s']:.2f}"),
    ("host pages dropped (LRU)", lambda f: f"{f['host_pages_dropped']:,.0f}"),
    ("host pages used / capacity at the end", lambda f: _host_pages(f)),
    ("requests retracted", lambda f: f"{f['retracted']:,.0f}"),
]


def _pair(f: dict[str, Any], name: str) -> str:
    return f"{f.get(name + '_p50_ms', float('nan')):,.0f} / {f.get(name + '_p90_ms', float('nan')):,.0f}"


def _share(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _working_set(f: dict[str, Any]) -> str:
    if f["working_set_tokens"] is None:
        return "–"
    return f"{f['working_set_tokens']:,.0f} ({f['working_set_x_pool']:.1f}x)"


def _host_pages(f: dict[str, Any]) -> str:
    if f["host_pages"] is None:
        return "–"
    return f"{f['host_pages_used']:,.0f} / {f['host_pages']:,.0f}"


def table(runs: dict[str, dict[str, Any]]) -> str:
    names = list(runs)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(runs[n]) for n in names) + " |")
    if len(names) == 2 and runs[names[0]]["host_pages"]:  # the first has a tier
        lines += ["", verdict(runs[names[0]], runs[names[1]])]
    return "\n".join(lines)


def verdict(tier: dict[str, Any], plain: dict[str, Any]) -> str:
    """Issue 43's targets: TTFT p50 >= 2x better, prefill tokens computed >= 40% fewer."""
    faster = plain["ttft_p50_ms"] / tier["ttft_p50_ms"] if tier["ttft_p50_ms"] else float("nan")
    computed = plain["prefill_tokens_computed"]
    fewer = 1 - tier["prefill_tokens_computed"] / computed if computed else float("nan")
    line = (
        f"with the tier: TTFT p50 {faster:.2f}x better (target >= 2x: "
        f"{'met' if faster >= 2 else 'not met'}), prefill tokens computed {fewer:.1%} fewer "
        f"(target >= 40%: {'met' if fewer >= 0.4 else 'not met'}"
    )
    if tier["reusable_share"] is None or not computed:
        return line + ")"
    # what a cache that forgets nothing would have left to compute, of the same admissions
    floor = tier["prompt_tokens_admitted"] * (1 - tier["reusable_share"])
    return line + f"; a cache that forgets nothing: {1 - floor / computed:.1%} fewer)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scrape")
    s.add_argument("log_dir", type=Path)
    s.add_argument("out", type=Path)
    t = sub.add_parser("table")
    t.add_argument("runs", nargs="+", help="NAME=DIR, the run with the tier first")
    t.add_argument("--pool", type=int, required=True, help="the GPU pool, tokens")
    t.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = ap.parse_args(argv)
    if args.command == "scrape":
        args.out.write_text(json.dumps(scrape(args.log_dir)))
        return 0
    runs = {}
    for spec in args.runs:
        name, _, folder = spec.partition("=")
        try:
            runs[name] = run_figures(Path(folder), args.pool)
        except (OSError, KeyError, ValueError) as exc:
            print(f"{name}: no figures from {folder}: {exc}", file=sys.stderr)
    if not runs:
        return 1
    print(table(runs))
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
