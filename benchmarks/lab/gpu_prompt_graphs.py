"""Time to first token by prompt length, with the prompt's CUDA graph and without, in one
engine (`engine/prefill_graph.py`).

    python -m baton.benchmarks.lab.gpu_prompt_graphs [--lens 16,128,512,1024,2048] [--runs 6]

Llama-3.1-8B shape, bf16, random weights, flashinfer, overlap on, as `gpu_engine`'s TTFT.
For each length the two modes alternate run by run (each prompt new: no prefix cache).
Beside the `generate` time it shows the GPU's own time for the forward: the same prompt's
forward timed by CUDA events while the GPU was held busy by a sleep kernel first, so that
every kernel was queued before the GPU reached it (no host in the way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from baton.benchmarks.lab.gpu_setup import make_engine, model_dir, prompts
from baton.benchmarks.lab.gpu_ttft import time_forward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lens", default="16,128,512,1024,2048")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--graph-tokens", type=int, default=None, help="the engine's default")
    ap.add_argument("--out", default="gpu_prompt_graphs.json")
    args = ap.parse_args(argv)
    from baton.common.sampling import SamplingParams

    engine = make_engine(
        model_dir(), "flashinfer", 200_000, 64, True, prompt_graph_tokens=args.graph_tokens
    )
    runner = engine.scheduler.runner
    graphs = runner.prefill_graphs
    if graphs is None:
        raise SystemExit("the engine captured no prompt graphs")
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    events = time_forward(runner)
    seed = iter(range(10_000, 10**9))
    rows = []
    device = torch.cuda.get_device_name(0)
    print(f"device {device}; largest prompt graph {graphs.sizes[-1]} tokens")
    print("| prompt | mode | TTFT best ms | median | GPU forward, host out of the way ms |")
    print("|---:|---|---:|---:|---:|")
    for n in (int(x) for x in args.lens.split(",")):
        times: dict[str, list[float]] = {"graph": [], "eager": []}
        gpu: dict[str, list[float]] = {"graph": [], "eager": []}
        for r in range(-1, args.runs):  # run -1: warm-up of both modes
            for mode in ("graph", "eager") if r % 2 else ("eager", "graph"):
                runner.prefill_graphs = graphs if mode == "graph" else None
                for held in (False, True):
                    p = prompts(1, n, seed=next(seed))
                    torch.cuda.synchronize()
                    if held:
                        torch.cuda._sleep(100_000_000)  # ~50 ms: the host queues everything
                    t = time.perf_counter()
                    engine.generate(p, one)
                    wall = (time.perf_counter() - t) * 1e3
                    torch.cuda.synchronize()
                    if r < 0:
                        continue
                    if held:
                        gpu[mode].append(events["start"].elapsed_time(events["end"]))
                    else:
                        times[mode].append(wall)
        runner.prefill_graphs = graphs
        for mode in ("eager", "graph"):
            row = {
                "prompt": n,
                "mode": mode,
                "graphed": mode == "graph" and n <= graphs.sizes[-1],
                "ttft_best_ms": min(times[mode]),
                "ttft_median_ms": statistics.median(times[mode]),
                "gpu_forward_ms": statistics.median(gpu[mode]),
                "runs_ms": times[mode],
            }
            rows.append(row)
            print(
                f"| {n} | {mode} | {row['ttft_best_ms']:.2f} | {row['ttft_median_ms']:.2f} | "
                f"{row['gpu_forward_ms']:.2f} |",
                flush=True,
            )
    engine.shutdown()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "command": "python -m baton.benchmarks.lab.gpu_prompt_graphs " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
