"""The decode step's projections at small batches, cuBLAS against alternatives, per shape of
the Llama-3.1-8B model (GPU; a diagnostic for the engine issue).

    python -m baton.benchmarks.lab.gpu_linear [--batches 1,8,32] [--out gpu_linear.json]

For each projection (qkv, o, gate_up, down, lm_head) and batch M it times:
- `linear`: `F.linear(x, w)`, the model's call today;
- `swapped`: `(w @ xᵀ)ᵀ`, which lets cuBLAS pick from its kernels for a tall matrix;
- `cublaslt`: `F.linear` with torch's preferred BLAS library set to cuBLASLt;
- `skinny`: `common/layers/skinny.py` at each block shape of `CONFIGS`.

Each variant runs as the model runs it, inside a CUDA graph: one graph of `--reps` calls,
each on its own copy of the weight, enough copies that they do not fit in L2, so every call
reads its weight from HBM. Time is per call (CUDA events around a replay); TB/s is the
weight's bytes over that time. Every variant's output is checked against `linear`'s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# (name, K, N) of one layer's projections and the LM head, Llama-3.1-8B (vocab 128,256)
SHAPES = [
    ("qkv", 4096, 6144),
    ("o", 4096, 4096),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
    ("lm_head", 4096, 128256),
]
L2_BYTES = 256 * 2**20  # more than any GPU's L2: copies beyond it come from HBM
# skinny's (block_n, block_k, num_warps, num_stages); --configs names others as
# BNxBKwWARPSsSTAGES, e.g. 64x256w4s4
CONFIGS = [
    (16, 256, 4, 3),
    (32, 256, 4, 3),
    (32, 512, 4, 3),
    (64, 256, 4, 4),
    (64, 128, 4, 4),
    (128, 128, 8, 3),
]


def parse_config(text: str) -> tuple[int, int, int, int]:
    """'64x256w4s4' -> (64, 256, 4, 4)."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text)
    if m is None:
        raise ValueError(f"config {text!r} is not BNxBKwWsS")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def time_in_graph(fn: Callable[[int], torch.Tensor], reps: int) -> float:
    """Seconds per call of `fn(i)`, i = 0..reps-1, captured in one CUDA graph."""
    for i in range(2):  # compile, allocate, autotune outside the graph
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def _call(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    ws: list[torch.Tensor],
    i: int,
) -> torch.Tensor:
    return fn(x, ws[i % len(ws)])


def bench_shape(
    name: str, k: int, n: int, m: int, reps: int, configs: list[tuple[int, int, int, int]]
) -> list[dict[str, Any]]:
    from baton.common.layers.skinny import skinny_linear

    dtype, dev = torch.bfloat16, torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-L2_BYTES // nbytes) + 1)
    ws = [torch.randn(n, k, dtype=dtype, device=dev) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=dtype, device=dev)
    ref = F.linear(x, ws[0]).float()

    def cublaslt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return F.linear(x, w)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    variants: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "linear": F.linear,
        "swapped": lambda x, w: (w @ x.T).T,
        "cublaslt": cublaslt,
    }
    for bn, bk, warps, stages in configs:
        variants[f"skinny {bn}x{bk} w{warps} s{stages}"] = partial(
            skinny_linear, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages
        )
    rows = []
    for variant, fn in variants.items():
        try:
            err = (fn(x, ws[0]).float() - ref).abs().max().item()
            t = time_in_graph(partial(_call, fn, x, ws), reps)
        except Exception as exc:  # a variant that fails to build is reported, not fatal
            rows.append({"shape": name, "m": m, "variant": variant, "error": str(exc)[:200]})
            continue
        rows.append(
            {
                "shape": name,
                "m": m,
                "n": n,
                "k": k,
                "variant": variant,
                "us": t * 1e6,
                "TBps": nbytes / t / 1e12,
                "max_abs_err": err,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=20, help="calls per graph")
    ap.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    ap.add_argument("--configs", default="", help="skinny's block shapes, comma-separated")
    ap.add_argument("--out", default="gpu_linear.json")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs.split(",") if c] or CONFIGS
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "command": "python -m baton.benchmarks.lab.gpu_linear " + " ".join(argv or sys.argv[1:]),
        "torch": torch.__version__,
        "rows": [],
    }
    print("| shape | M | variant | µs | TB/s | max abs err |\n|---|---:|---|---:|---:|---:|")
    for m in (int(b) for b in args.batches.split(",")):
        for name, k, n in (shape for shape in SHAPES if shape[0] in args.shapes.split(",")):
            rows = bench_shape(name, k, n, m, args.reps, configs)
            torch.cuda.empty_cache()  # the shape's weight copies
            result["rows"] += rows
            ok = [r for r in rows if "us" in r]
            best = min(ok, key=lambda r: r["us"])["variant"] if ok else None
            for r in rows:
                if "error" in r:
                    print(f"| {name} | {m} | {r['variant']} | failed: {r['error']} | | |")
                    continue
                mark = " **best**" if r["variant"] == best else ""
                print(
                    f"| {name} | {m} | {r['variant']}{mark} | {r['us']:.1f} | "
                    f"{r['TBps']:.2f} | {r['max_abs_err']:.3g} |",
                    flush=True,
                )
            Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
