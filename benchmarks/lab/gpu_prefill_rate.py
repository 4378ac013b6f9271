"""Prompt tokens a second one GPU computes, the engine alone, against the GPU's matmul rate
(issue 38: 2P2D on 4x H200 topped out at ~55 req/s of 1,330-token prompts, ~37k prompt
tokens/s per prefill GPU, ~530 TFLOP/s, where one 2,048-token prompt alone runs at ~730).

    python -m baton.benchmarks.lab.gpu_prefill_rate [--prompts 400] [--input-len 1330] \
        [--budgets 8192,16384,32768] [--out gpu_prefill_rate.json]

For each step budget (the engine's --max-prefill-tokens): an engine without CUDA graphs
(one token out: no decode step to capture), a warm-up, then --prompts prompts submitted at
once, one token out each; prompt tokens/s and the FLOP rate that is (`floors.prefill_flops`).
The GPU's bf16 matmul rate is measured from idle (a 28 ms burst, the floors' rate) and
sustained for --sustain-s seconds (a GPU's clock falls under sustained load), so the
prompts' rate can be read against what the GPU keeps up. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from baton.benchmarks.lab.device_rates import Matmuls, measure_matmul
from baton.benchmarks.lab.floors import prefill_flops
from baton.benchmarks.lab.gpu_setup import (
    LLAMA_31_8B,
    make_engine,
    markdown_table,
    model_dir,
    prompts,
    run_header,
)


def sustained_matmul(matmuls: Matmuls, seconds: float) -> float:
    """FLOP/s of back-to-back 8,192-cubed matmuls kept up for about `seconds`."""
    burst = matmuls.rate(20 * 2 * Matmuls.SIZE**3)
    return matmuls.rate(burst * seconds)


def prompt_rate(engine, n: int, length: int, seed: int) -> dict[str, float]:
    """All `n` prompts at once, one token out each: prompt tokens a second."""
    from baton.common.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts(min(n, 32), length, seed=seed + 1), params)  # warm-up
    batch = prompts(n, length, seed=seed)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(batch, params)
    seconds = time.perf_counter() - t
    assert len(outs) == n
    tokens = n * length
    flops = n * prefill_flops(LLAMA_31_8B, length)
    return {
        "prompts": n,
        "input_len": length,
        "seconds": seconds,
        "prompt_tok_s": tokens / seconds,
        "TFLOPs": flops / seconds / 1e12,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--input-len", type=int, default=1330)
    ap.add_argument("--budgets", default="8192,16384,32768", help="--max-prefill-tokens values")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--sustain-s", type=float, default=5.0)
    ap.add_argument("--max-total-tokens", type=int, default=600_000)
    ap.add_argument("--out", default="gpu_prefill_rate.json")
    args = ap.parse_args(argv)

    result: dict[str, Any] = {
        **run_header("gpu_prefill_rate"),
        "backend": args.backend,
        "model": "Llama-3.1-8B config",
        "runs": [],
    }
    matmuls = Matmuls()
    burst = measure_matmul(matmuls)
    sustained = sustained_matmul(matmuls, args.sustain_s)
    result["matmul_TFLOPs"] = {"burst": burst / 1e12, "sustained": sustained / 1e12}
    print(
        f"bf16 matmul {burst / 1e12:.0f} TFLOP/s from idle, {sustained / 1e12:.0f} "
        f"sustained {args.sustain_s:g} s",
        flush=True,
    )
    del matmuls
    torch.cuda.empty_cache()
    path = model_dir()
    for budget in (int(b) for b in args.budgets.split(",")):
        engine = make_engine(
            path,
            args.backend,
            args.max_total_tokens,
            max(256, budget // args.input_len + 1),
            graphs=False,
            max_prefill_tokens=budget,
            chunked_prefill_size=budget,
        )
        run = {"budget": budget, **prompt_rate(engine, args.prompts, args.input_len, seed=7)}
        run["x_sustained"] = run["TFLOPs"] * 1e12 / sustained
        result["runs"].append(run)
        print(
            f"budget {budget}: {run['prompt_tok_s']:.0f} prompt tok/s, {run['TFLOPs']:.0f} "
            f"TFLOP/s ({run['x_sustained']:.2f} of the sustained matmul rate)",
            flush=True,
        )
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print(
        markdown_table(
            result["runs"],
            [
                ("step budget", "budget", "d"),
                ("prompts", "prompts", "d"),
                ("prompt tok/s", "prompt_tok_s", ".0f"),
                ("TFLOP/s", "TFLOPs", ".0f"),
                ("of sustained matmul", "x_sustained", ".2f"),
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
