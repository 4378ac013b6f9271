"""What a prompt chunk costs inside a decode step (a diagnostic): one GPU, the engine alone.

    python -m baton.benchmarks.lab.gpu_mixed_step [--batches 32,128] [--chunks 256,512,1024,2048]

A decode worker that computes a prompt itself (issue 40's local placement), and an
aggregated worker with --enable-mixed-chunk, run the prompt's chunks in the same steps as
their running requests. On an H200, agg1 with --enable-mixed-chunk --chunked-prefill-size
512 carried under 10.4 req/s of 1,330 in / 256 out where the default carried 14. For each
decode batch B (context --context) and chunk size n: the decode step of B alone (a CUDA
graph), the chunk alone (no request running), and the mixed step (B rows and the chunk),
each the median of its steps, and the mixed step with every row through the prompt kernel
(`unsplit`: before `HybridBackend` split mixed steps); for mixed steps also the host's time
launching one (the forward thread's), of which its attention's plans, and its span on the
GPU (`Spans`); the GPU's time by kernel in mixed steps at chunk 512. The mixed steps
replay CUDA graphs between their attentions (`--piecewise-graph-max-tokens`); `eager` is
the same step launched layer by layer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any
from unittest import mock

import torch

from baton.benchmarks.lab.gpu_profile import device_table
from baton.benchmarks.lab.gpu_setup import make_engine, markdown_table, model_dir, prompts


def step_times(sched, until) -> list[float]:
    """Seconds of each scheduler step until `until()` holds."""
    marks = [time.perf_counter()]
    while not until():
        sched.step()
        marks.append(time.perf_counter())
    torch.cuda.synchronize()
    return [b - a for a, b in itertools.pairwise(marks)]


class Spans:
    """Each step the runner executes meanwhile: the host's time launching it (the forward
    thread's) and its span on the GPU (an event before its launch to one after), ms."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.host: list[float] = []
        self.plan: list[float] = []  # of which the attention's `prepare` (its plans)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> Spans:
        execute = self.runner.execute

        def timed(step):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            self.plan.append(0.0)  # a step replaying a graph plans nothing
            start.record()
            result = execute(step)
            end.record()
            self.host.append(1e3 * (time.perf_counter() - t))
            self.events.append((start, end))
            return result

        prepare = self.runner.attn.prepare

        def planned(batch):
            t = time.perf_counter()
            prepare(batch)
            if self.plan:  # (not a step launched before these patches, still running)
                self.plan[-1] += 1e3 * (time.perf_counter() - t)

        self._patches = [
            mock.patch.object(self.runner, "execute", timed),
            mock.patch.object(self.runner.attn, "prepare", planned),
        ]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for patch in self._patches:
            patch.stop()

    def medians(self, first: int, last: int) -> dict[str, float]:
        """Median host, attention-plan and GPU ms of steps first..last-1."""
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e in self.events[first:last]]
        return {
            "host": statistics.median(self.host[first:last]),
            "plan": statistics.median(self.plan[first:last]),
            "gpu": statistics.median(gpu),
        }


def chunk_steps(sched, rid: str, prompt: list[int], n: int) -> dict[str, float]:
    """The steps that compute `prompt` in chunks of `n` (the last, partial one left out):
    median wall, host and GPU ms (`Spans`)."""
    from baton.common.sampling import SamplingParams

    sched.prefill.token_budget = n
    sched.prefill.chunked = True
    req = sched.add_request(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=1))
    with Spans(sched.runner) as spans:
        times = step_times(sched, lambda: len(req.output_ids) >= 1 or req.finished)
    last = len(prompt) // n  # the first step also processed what came before
    return {"wall": 1e3 * statistics.median(times[1:last]), **spans.medians(1, last)}


def run(
    engine, bs: int, ctx: int, n: int, length: int, profile: bool, mixed_prompts: int = 1
) -> dict[str, Any]:
    """One decode batch and chunk size: every prompt its own (no prefix-cache hit).
    `mixed_prompts`: prompts computed in mixed steps, one after the other (medians of each
    one's medians); 0: eight of them and nothing else, for a profiler to sample."""
    from baton.common.attention import base
    from baton.common.sampling import SamplingParams

    sched = engine.scheduler
    only_mixed = mixed_prompts == 0
    count = mixed_prompts or 8
    seeds = iter(range(1000 * bs + n, 1000 * bs + n + 10 + count))

    def chunked(tag: str) -> dict[str, float]:
        return chunk_steps(sched, f"{tag}{bs}-{n}", prompts(1, length, seed=next(seeds))[0], n)

    alone = {"wall": float("nan")} if only_mixed else chunked("a")
    sched.drain()
    params = SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True)
    for i, p in enumerate(prompts(bs, ctx, seed=next(seeds))):
        sched.add_request(f"d{bs}-{n}-{i}", p, params)
    sched.prefill.token_budget = 16384
    while any(len(r.output_ids) < 4 for r in sched.decode.running) or len(sched.prefill):
        sched.step()
    left = iter(range(32))
    decode = step_times(sched, lambda: next(left, None) is None)[4:]
    each = [chunked("m") for _ in range(count)]
    mixed = {key: statistics.median(m[key] for m in each) for key in each[0]}
    unsplit = {"wall": float("nan")}
    eager = {"wall": float("nan"), "host": float("nan"), "gpu": float("nan")}
    if not only_mixed and sched.runner.piecewise_graphs is not None:
        with mock.patch.object(sched.runner, "piecewise_graphs", None):
            eager = chunked("e")  # launched layer by layer, as before the pieces
    if not only_mixed:
        with mock.patch.object(base._Split, "of", staticmethod(lambda batch: None)):
            unsplit = chunked("u")  # every row through the prompt kernel, as before the split
    table = ""
    if profile and not only_mixed:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            chunked("p")
        table = device_table(prof, length // n + 1, "mixed step (about)", rows=20)
    for req in list(sched.decode.running):
        sched.abort(req.rid)
    sched.drain()
    row: dict[str, Any] = {
        "batch": bs,
        "chunk": n,
        "decode_ms": 1e3 * statistics.median(decode),
        "chunk_alone_ms": alone["wall"],
        "mixed_ms": mixed["wall"],
        "mixed_host_ms": mixed["host"],
        "mixed_plan_ms": mixed["plan"],
        "mixed_gpu_ms": mixed["gpu"],
        "unsplit_ms": unsplit["wall"],
        "eager_ms": eager["wall"],
        "eager_host_ms": eager["host"],
        "eager_gpu_ms": eager["gpu"],
    }
    row["extra_ms"] = row["mixed_ms"] - row["decode_ms"] - row["chunk_alone_ms"]
    row["profile"] = table
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,128,200")
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--context", type=int, default=1460)
    ap.add_argument("--prompt-len", type=int, default=6144)
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--disable-overlap", action="store_true")
    ap.add_argument(
        "--piecewise-max-tokens",
        type=int,
        default=2048,
        help="--piecewise-graph-max-tokens (0: every mixed step eager, no comparison)",
    )
    ap.add_argument(
        "--mixed-prompts",
        type=int,
        default=1,
        help="prompts computed in mixed steps at each point; 0: 8 of them and nothing else "
        "(no chunk alone, no unsplit steps, no torch profile), for py-spy to sample",
    )
    ap.add_argument("--out", default="gpu_mixed_step.json")
    args = ap.parse_args(argv)
    engine = make_engine(
        model_dir(),
        args.backend,
        400_000,
        256,
        True,
        overlap=not args.disable_overlap,
        enable_mixed_chunk=True,
        chunked_prefill_size=512,
        piecewise_graph_max_tokens=args.piecewise_max_tokens,
    )
    run(engine, 8, 256, 256, 1024, profile=False)  # kernels built, shapes tuned
    rows = []
    for bs in (int(b) for b in args.batches.split(",")):
        for n in (int(c) for c in args.chunks.split(",")):
            row = run(
                engine,
                bs,
                args.context,
                n,
                args.prompt_len,
                profile=n == 512,
                mixed_prompts=args.mixed_prompts,
            )
            rows.append(row)
            print(
                f"batch {bs}, chunk {n}: decode {row['decode_ms']:.2f} ms, chunk alone "
                f"{row['chunk_alone_ms']:.2f}, mixed {row['mixed_ms']:.2f} (extra "
                f"{row['extra_ms']:+.2f}), unsplit {row['unsplit_ms']:.2f}, eager "
                f"{row['eager_ms']:.2f} (launch {row['eager_host_ms']:.2f}, GPU "
                f"{row['eager_gpu_ms']:.2f})",
                flush=True,
            )
            if row["profile"]:
                print(row["profile"], flush=True)
            with open(args.out, "w") as f:
                json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=2)
    print()
    print(
        markdown_table(
            rows,
            [
                ("batch", "batch", "d"),
                ("chunk", "chunk", "d"),
                ("decode ms", "decode_ms", ".2f"),
                ("chunk alone ms", "chunk_alone_ms", ".2f"),
                ("mixed ms", "mixed_ms", ".2f"),
                ("its launch ms", "mixed_host_ms", ".2f"),
                ("of which plans ms", "mixed_plan_ms", ".2f"),
                ("its GPU span ms", "mixed_gpu_ms", ".2f"),
                ("unsplit ms", "unsplit_ms", ".2f"),
                ("eager ms", "eager_ms", ".2f"),
                ("eager launch ms", "eager_host_ms", ".2f"),
                ("eager GPU ms", "eager_gpu_ms", ".2f"),
                ("mixed - both ms", "extra_ms", "+.2f"),
            ],
        )
    )
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
