"""Where the host time of a steady decode step goes (a diagnostic, not a benchmark).

    python -m baton.benchmarks.gpu_host_profile [--bs 1]

Runs with overlap off so every host function is on one thread for cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

from baton.benchmarks.gpu_engine import model_dir, prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=1)
    args = ap.parse_args(argv)
    from baton.common.engine import Engine
    from baton.common.sampling import SamplingParams

    engine = Engine(
        model_dir(),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend="flashinfer",
        page_size=16,
        max_total_tokens=200_000,
        max_running_requests=64,
        disable_overlap=True,
    )
    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    for i, p in enumerate(prompts(args.bs, 2048, seed=1)):
        sched.add_request(f"r{i}", p, params)
    for _ in range(10):
        sched.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        sched.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
