"""The scheduler with the prefix cache on vs off and overlap on vs off.

    python -m baton.benchmarks.micro.cache_and_overlap [--model DIR]

1. Shared-prefix workload (32 requests behind a common 200-token prefix, two passes):
   wall time and prefix-hit rate with the radix cache on and off.
2. Decode at batch 1 and 32: host time per step (scheduling + input preparation, the work
   overlap hides) and wall time per step, with overlap on and off.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams


def shared_prefix(model: str, cache: bool) -> dict[str, float]:
    rng = random.Random(0)
    prefix = [rng.randrange(10, 2000) for _ in range(200)]
    prompts = [prefix + [rng.randrange(10, 2000) for _ in range(16)] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with Engine(
        model, page_size=16, max_total_tokens=32768, disable_radix_cache=not cache
    ) as engine:
        engine.generate(prompts[:1], params)
        before = engine.stats()
        t = time.perf_counter()
        engine.generate(prompts, params)
        engine.generate(prompts, params)
        dt = time.perf_counter() - t
        after = engine.stats()
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    total = after.prompt_tokens - before.prompt_tokens
    return {"seconds": dt, "hit_rate": hits / total if total else 0.0}


def step_times(model: str, batch: int, overlap: bool, steps: int = 64) -> dict[str, float]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(10, 2000) for _ in range(32)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
    with Engine(model, page_size=16, disable_overlap=not overlap) as engine:
        sched = engine.scheduler
        host = 0.0
        original = sched.runner.prepare

        def timed_prepare(*a, **k):
            nonlocal host
            t0 = time.perf_counter()
            out = original(*a, **k)
            host += time.perf_counter() - t0
            return out

        sched.runner.prepare = timed_prepare  # type: ignore[method-assign]
        for i, p in enumerate(prompts):
            sched.add_request(f"r{i}", p, params)
        for _ in range(4):  # prefill + warm-up
            sched.step()
        host = 0.0
        sched_time = 0.0
        t = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            sched.step()
            sched_time += time.perf_counter() - t0
        wall = time.perf_counter() - t
        sched.drain()
    return {"wall_ms_per_step": 1e3 * wall / steps, "prepare_ms_per_step": 1e3 * host / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="benchmarks/results/scheduler.json")
    args = ap.parse_args(argv)
    if args.model is None:
        from baton.common.models.tiny import default_model_path

        args.model = str(default_model_path())
    cache = {"on": shared_prefix(args.model, True), "off": shared_prefix(args.model, False)}
    steps = {
        f"bs{b}-{'overlap' if o else 'no-overlap'}": step_times(args.model, b, o)
        for b in (1, 32)
        for o in (True, False)
    }
    print("shared-prefix workload (32 requests, 200-token common prefix, two passes)")
    print(f"{'radix cache':>12} {'seconds':>8} {'hit rate':>9}")
    for k, v in cache.items():
        print(f"{k:>12} {v['seconds']:>8.2f} {v['hit_rate']:>8.1%}")
    print(f"cache on is {cache['off']['seconds'] / cache['on']['seconds']:.2f}x faster")
    print("\ndecode steps")
    print(f"{'mode':>20} {'wall ms/step':>13} {'prepare ms/step':>16}")
    for k, v in steps.items():
        print(f"{k:>20} {v['wall_ms_per_step']:>13.2f} {v['prepare_ms_per_step']:>16.2f}")
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
        "command": "python -m baton.benchmarks.micro.cache_and_overlap " + " ".join(sys.argv[1:]),
        "shared_prefix": cache,
        "decode_steps": steps,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
