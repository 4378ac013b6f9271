"""Where a step's time goes on the GPU (a diagnostic, not a benchmark).

python -m baton.benchmarks.lab.gpu_profile [--backend flashinfer] [--bs 1] [--sampling greedy]

Prints the time of a steady decode step and of a graph replay, a profile of five decode
steps (host and device), and the GPU's time by kernel per decode step and per prompt of
`--prompt-len` tokens alone in its step (kernels inside CUDA graphs included).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from baton.benchmarks.lab.gpu_setup import make_engine, model_dir, prompts


def timed(fn, n: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def device_table(prof, per: int, what: str, rows: int = 30) -> str:
    """The GPU's time by kernel (or copy), kernels inside CUDA graphs included, per `what`."""
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    lines = [
        f"GPU time per {what}: {total / per / 1e3:.3f} ms",
        "| µs | share | launches | µs a launch | kernel |",
        "|---:|---:|---:|---:|---|",
    ]
    for e in events[:rows]:
        t = e.self_device_time_total
        lines.append(
            f"| {t / per:.1f} | {t / total:.1%} | {e.count // per} | {t / e.count:.1f} "
            f"| {e.key[:90]} |"
        )
    return "\n".join(lines)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--context", type=int, default=2048, help="decode rows' prompt length")
    ap.add_argument("--decode-backend", default=None, help="decode's attention, if not the default")
    ap.add_argument(
        "--sampling", default="greedy", help="how the decode steps sample, as gpu_engine's"
    )
    args = ap.parse_args(argv)
    from baton.benchmarks.lab.gpu_setup import sampling_knobs
    from baton.common.sampling import SamplingParams

    pool = max(200_000, args.bs * (args.context + 450))
    engine = make_engine(
        model_dir(), args.backend, pool, max(64, args.bs), True, decode_backend=args.decode_backend
    )
    sched = engine.scheduler
    runner = sched.runner
    print("graphs:", runner.graphs is not None and runner.graphs.sizes)
    knobs = sampling_knobs(args.sampling)
    params = SamplingParams(**knobs, max_new_tokens=400, ignore_eos=True)
    for i, p in enumerate(prompts(args.bs, args.context, seed=1)):
        sched.add_request(f"r{i}", p, params)
    for _ in range(6):
        sched.step()
    print(f"scheduler.step: {timed(sched.step):.2f} ms")
    if runner.graphs is not None:
        # the last step's inputs are still in the graph's buffers: a replay recomputes the
        # same values (host time per step: benchmarks/lab/gpu_host_profile.py)
        g = runner.graphs
        torch.cuda.synchronize()
        bs = next(s for s in g.sizes if s >= args.bs)
        print(f"graph replay only: {timed(lambda: g.graphs[bs].replay()):.2f} ms")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(5):
            sched.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    )
    print(device_table(prof, 5, f"decode step, batch {args.bs}"))
    sched.drain()
    # a prompt alone in its step, as a request's first token finds it (its CUDA graph, where
    # it has one), once warmed up
    once = SamplingParams(temperature=0, max_new_tokens=1)
    engine.generate(prompts(1, args.prompt_len, seed=4), once)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        engine.generate(prompts(1, args.prompt_len, seed=5), once)
        torch.cuda.synchronize()
    print(device_table(prof, 1, f"prefill of {args.prompt_len:,} tokens"))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
