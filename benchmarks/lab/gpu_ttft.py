"""Where the time to first token of one prompt goes, phase by phase, host and GPU (a
diagnostic for the engine issue, not a benchmark).

    python -m baton.benchmarks.lab.gpu_ttft [--prompt 2048] [--runs 5]

Runs the engine as `gpu_engine`'s TTFT does (overlap on, flashinfer) and wraps the phases
of a prefill step with host timestamps (`time.perf_counter`, taken on whichever thread runs
the phase) and CUDA events, without a profiler. Prints, per phase, when it started and
ended on the host relative to the `generate` call, and when the GPU began and ended the
model's forward: the host time before the GPU gets work, the time the GPU runs, and the
host time after it.

`--warm-ms 0,40` repeats the runs with the GPU kept busy (bf16 matmuls for about that many
ms, queued just before the prompt) so that it never idles before the forward: whether a
forward that starts on an idle GPU runs slower than on a busy one (clocks), as the
difference between the event-timed forward and its kernels under the profiler suggested.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from baton.benchmarks.lab.gpu_setup import make_engine, model_dir, prompts

Marks = dict[str, tuple[float, float]]


def _wrap(obj: Any, name: str, label: str, marks: Marks) -> None:
    """Record (start, end) host times of the first call of obj.name under `label`."""
    fn: Callable[..., Any] = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            marks.setdefault(
                label, (t, time.perf_counter())
            )  # the first call after the clock starts

    setattr(obj, name, timed)


def time_forward(runner: Any) -> dict[str, torch.cuda.Event]:
    """Wrap the model runner's forward (the eager one or a prompt graph's replay) in CUDA
    events; the returned dict holds the "start" and "end" of its latest call."""
    events: dict[str, torch.cuda.Event] = {}
    forward = runner._model_forward

    def timed(*a: Any, **k: Any) -> Any:
        events["start"] = torch.cuda.Event(enable_timing=True)
        events["end"] = torch.cuda.Event(enable_timing=True)
        events["start"].record()
        out = forward(*a, **k)
        events["end"].record()
        return out

    runner._model_forward = timed
    return events


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warm-ms", default="0", help="comma-separated; 0: the GPU idles before")
    ap.add_argument("--no-overlap", action="store_true", help="the forward on the calling thread")
    args = ap.parse_args(argv)
    from baton.common.sampling import SamplingParams

    engine = make_engine(model_dir(), "flashinfer", 200_000, 64, True, overlap=not args.no_overlap)
    sched, runner = engine.scheduler, engine.scheduler.runner
    marks: Marks = {}
    gpu = time_forward(runner)
    _wrap(sched, "_schedule", "schedule", marks)
    _wrap(runner, "prepare", "runner.prepare (inputs uploaded)", marks)
    _wrap(runner, "execute", "runner.execute (forward thread)", marks)
    _wrap(runner.table, "write_many", "req-to-token writes", marks)
    _wrap(runner.attn, "prepare", "attention plan", marks)
    _wrap(runner, "_model_forward", "model forward launched (or its graph replayed)", marks)
    prompt_attn = getattr(runner.attn, "prefill_backend", runner.attn)  # HybridBackend's half
    _wrap(prompt_attn.ragged_wrapper, "plan", "flashinfer's ragged plan", marks)
    _wrap(sched, "_launch", "scheduler: prepare and submit", marks)
    _wrap(sched.prefill, "schedule", "prefill schedule", marks)
    _wrap(sched.decode, "schedule", "decode schedule", marks)
    from baton.common.engine import model_runner

    _wrap(model_runner, "resolve_future", "resolve_future", marks)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts(1, args.prompt, seed=1), one)  # warm-up
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for w, warm_ms in enumerate(float(w) for w in args.warm_ms.split(",")):
        rows: list[Marks] = []
        for r in range(args.runs):
            p = prompts(1, args.prompt, seed=100 + 1000 * w + r)  # never in the prefix cache
            torch.cuda.synchronize()
            marks.clear()
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            for _ in range(round(warm_ms / 1.4)):  # an 8192^3 bf16 matmul: about 1.4 ms
                a @ a
            t0 = time.perf_counter()
            engine.generate(p, one)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            # the GPU's clock against the host's: the anchor event completed at about t0
            g0 = anchor.elapsed_time(gpu["start"]) / 1e3
            g1 = anchor.elapsed_time(gpu["end"]) / 1e3
            row = {label: (s - t0, e - t0) for label, (s, e) in marks.items()}
            row["GPU: model forward"] = (g0, g1)
            row["generate returned"] = (t1 - t0, t1 - t0)
            rows.append(row)
        print(
            f"device {torch.cuda.get_device_name(0)}; prompt {args.prompt} tokens; "
            f"{args.runs} runs; GPU kept busy {warm_ms:g} ms before"
        )
        ranked = sorted(rows, key=lambda row: row["generate returned"][0])
        for which, row in (("best", ranked[0]), ("slowest", ranked[-1])):
            print(
                f"{which} run:\n| phase | host/GPU start ms | end ms | ms |\n|---|---:|---:|---:|"
            )
            for label, (s, e) in sorted(row.items(), key=lambda kv: kv[1][0]):
                print(f"| {label} | {s * 1e3:.2f} | {e * 1e3:.2f} | {(e - s) * 1e3:.2f} |")
        labels = sorted(
            {label for row in rows for label in row}, key=lambda lb: rows[0].get(lb, (0,))[0]
        )
        print(f"median of the {len(rows)} runs:\n| phase | start ms | end ms |\n|---|---:|---:|")
        for label in labels:
            spans = [row[label] for row in rows if label in row]
            s_med = statistics.median(s for s, _ in spans) * 1e3
            e_med = statistics.median(e for _, e in spans) * 1e3
            print(f"| {label} | {s_med:.2f} | {e_med:.2f} |")
        totals = [row["generate returned"][0] * 1e3 for row in rows]
        forwards = [
            (row["GPU: model forward"][1] - row["GPU: model forward"][0]) * 1e3 for row in rows
        ]
        print("generate, every run (ms):", " ".join(f"{t:.1f}" for t in totals))
        print("GPU forward, every run (ms):", " ".join(f"{t:.2f}" for t in forwards))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
