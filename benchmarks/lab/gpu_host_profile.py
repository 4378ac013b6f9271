"""Where the host time of a steady decode step goes (a diagnostic, not a benchmark).

    python -m baton.benchmarks.lab.gpu_host_profile [--bs 1]
    python -m baton.benchmarks.lab.gpu_host_profile --prefill 2048   (a prompt's first token)

Runs with overlap off so every host function is on one thread for cProfile. With
``--prefill N`` it profiles 20 generations of one N-token prompt's first token instead,
in the engine `gpu_engine` measures TTFT with (CUDA graphs, overlap on: a lone prompt's
step is launched by the scheduler thread; the wait for the GPU shows as `synchronize`).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from baton.benchmarks.lab.gpu_setup import make_engine, model_dir, prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0)
    args = ap.parse_args(argv)
    from baton.common.sampling import SamplingParams

    # as gpu_engine builds it; a prompt's TTFT as measured there, overlap on (a lone
    # prompt's step is launched on this thread), decode steps with overlap off
    engine = make_engine(model_dir(), "flashinfer", 200_000, 64, True, overlap=bool(args.prefill))
    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)

    fresh = iter(prompts(40, args.prefill, seed=10) if args.prefill else [])  # never cached

    def run() -> None:
        if args.prefill:
            for _ in range(20):
                engine.generate([next(fresh)], one)
        else:
            for _ in range(50):
                sched.step()
        torch.cuda.synchronize()

    if args.prefill:
        engine.generate(prompts(1, args.prefill, seed=1), one)
    else:
        for i, p in enumerate(prompts(args.bs, 2048, seed=1)):
            sched.add_request(f"r{i}", p, params)
        for _ in range(10):
            sched.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    print(f"unprofiled: {(time.perf_counter() - t) * 1e3:.1f} ms")
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
