"""A prompt's MLP activation, cuBLAS's gate/up GEMM plus baton's SiLU·mul kernel against
`common/layers/gate_up.py`'s one GEMM with SiLU·mul in its epilogue (GPU; a diagnostic
for the engine issue's TTFT).

    python -m baton.benchmarks.lab.gpu_gate_up [--rows 33,64,128,256,512,2048,8192] [--out gpu_gate_up.json]

Llama-3.1-8B's gate/up shape (K 4,096, gate and up 14,336 each), bf16. For each row count
it times, in rounds that take the variants in turn (so that a falling clock under load
hits them alike), the best of the rounds per call:
- `gemm`: `F.linear(x, w)` alone (cuBLAS), for its TFLOP/s;
- `separate`: `F.linear` then `kernels.silu_and_mul`, the model's path before;
- `fused` at each configuration of `CONFIGS` (block M, block K, group M, warps, stages),
  on the interleaved weight.
Every fused output is compared with `separate`'s (largest difference, share of equal
elements). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from baton.common.layers.gate_up import DEFAULT, Config, gate_up_silu, interleave, silu_and_mul

K, N = 4096, 14336
CONFIGS = [
    DEFAULT,
    Config(128, 64, 8, 8, 4),
    Config(64, 64, 8, 4, 4),
    Config(64, 64, 8, 4, 3),
]


def _separate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(F.linear(x, w))


def time_rounds(
    fns: dict[str, Callable[[], torch.Tensor]], calls: int, rounds: int
) -> dict[str, float]:
    """Seconds per call of each fn: the best of `rounds` rounds of `calls` calls, the fns
    taken in turn within each round."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / 1e3 / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="33,64,128,256,512,2048,8192")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/gpu_gate_up.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    w = (torch.randn(2 * N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    w_il = interleave(w)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "command": "python -m baton.benchmarks.lab.gpu_gate_up " + " ".join(sys.argv[1:]),
        "rows": [],
    }
    print("| rows | variant | µs | TFLOP/s | vs separate | max diff | equal |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        ref = silu_and_mul(F.linear(x, w))
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "gemm": partial(F.linear, x, w),
            "separate": partial(_separate, x, w),
        }
        checks: dict[str, tuple[float, float]] = {}
        for c in CONFIGS:
            name = "fused " + ",".join(str(int(v)) for v in c)
            try:
                y = gate_up_silu(x, w_il, c)
                torch.cuda.synchronize()
            except Exception as e:  # a configuration that does not compile (shared memory)
                print(f"| {m} | {name} | failed: {type(e).__name__}: {str(e)[:80]} |||||")
                continue
            diff = (y.float() - ref.float()).abs().max().item()
            checks[name] = (diff, (y == ref).float().mean().item())
            fns[name] = partial(gate_up_silu, x, w_il, c)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        times = time_rounds(fns, args.calls, args.rounds)
        flops = 2 * m * K * 2 * N
        for name, t in times.items():
            diff, equal = checks.get(name, (0.0, 1.0))
            row = {
                "rows": m,
                "variant": name,
                "us": t * 1e6,
                "tflops": flops / t / 1e12,
                "vs_separate": t / times["separate"],
                "max_diff": diff,
                "equal": equal,
            }
            result["rows"].append(row)
            print(
                f"| {m} | {name} | {t * 1e6:.1f} | {row['tflops']:.0f} | "
                f"{row['vs_separate']:.3f} | {diff:.3g} | {equal:.4f} |",
                flush=True,
            )
        best = min((n for n in times if n.startswith("fused")), key=times.__getitem__, default=None)

        if best:
            print(
                f"best at {m} rows: {best} {times[best] * 1e6:.1f} µs, separate "
                f"{times['separate'] * 1e6:.1f} µs",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
