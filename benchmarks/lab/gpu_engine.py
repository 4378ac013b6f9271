"""GPU engine benchmark: Llama-3.1-8B-shaped random weights in bf16, against physical floors.

    python -m baton.benchmarks.lab.gpu_engine --out results.json [--sections decode,ttft,offline,hf]

Measured in one run: HBM bandwidth (device copy) and bf16 matmul rate, then
  decode    step time at batch 1..128 with 2,048 tokens of context, / memory floor
            (the bytes a step must read / bandwidth: weights without the embedding
            table, the gathered embedding rows, the KV attended; see `floors`)
  ttft      one 2,048-token prompt, / FLOP floor (FLOPs / matmul rate; LM head for the
            sampled row only): the best and the median of --ttft-runs, back to back or
            --ttft-pause-ms apart. After each prompt, the same pause and a burst of
            matmuls of the prompt's FLOPs: the floor under the same load (a GPU's clock
            falls under sustained load, the first floor's burst starts from idle)
  offline   N prompts of 1,024 in / 1,024 out (EOS ignored), output tokens/s
  hf        transformers' generate() on the same config and prompts (a subset), tokens/s
Prints one table at the end and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from baton.benchmarks.lab.device_rates import Matmuls, measure_bandwidth, measure_matmul
from baton.benchmarks.lab.floors import decode_read_bytes, kv_bytes_per_token, prefill_flops
from baton.benchmarks.lab.gpu_setup import (
    LLAMA_31_8B,
    HostTimes,
    SamplingKnobs,
    make_engine,
    model_dir,
    prompts,
    run_header,
    sampling_knobs,
)
from baton.common.engine.process import GcPauses


def bench_decode(
    engine,
    batches: list[int],
    ctx: int,
    bw: float,
    cfg: dict[str, Any],
    tp: int,
    knobs: SamplingKnobs | None = None,
) -> list[dict[str, float]]:
    """Each batch's steady decode step: the mean of 64 steps (the figure), with the median
    and the longest step and any garbage collection in them, so that one stall of the
    host shows as what it is. `knobs`: how every request samples (greedy by default)."""
    from baton.common.sampling import SamplingParams

    rows = []
    sched = engine.scheduler
    n = 64
    for bs in batches:
        params = SamplingParams(
            **(knobs or {"temperature": 0.0}), max_new_tokens=n + 32, ignore_eos=True
        )
        for i, p in enumerate(prompts(bs, ctx, seed=bs)):
            sched.add_request(f"d{bs}-{i}", p, params)
        while any(len(r.output_ids) < 4 for r in sched.decode.running) or len(sched.prefill):
            sched.step()
        if len(sched.decode.running) != bs:  # refused (past the model's positions, the pool)
            raise SystemExit(
                f"decode at batch {bs}, {ctx} tokens of context: only "
                f"{len(sched.decode.running)} requests run; nothing to time"
            )
        torch.cuda.synchronize()
        before = sum(r.device_len for r in sched.decode.running)
        # an older tree (engine_turns runs it with this benchmark) has no draw graphs
        draws = getattr(sched.step_stats(), "draw_graph_steps", 0)
        with GcPauses() as gcs, HostTimes(sched.runner) as host:
            marks = [time.perf_counter()]
            for _ in range(n):
                sched.step()
                marks.append(time.perf_counter())
            torch.cuda.synchronize()
            step = (time.perf_counter() - marks[0]) / n
        draws = getattr(sched.step_stats(), "draw_graph_steps", 0) - draws  # drawn in a graph
        steps = [b - a for a, b in itertools.pairwise(marks)]
        median, longest = statistics.median(steps), max(steps)
        # the timed steps attended before + bs, ..., before + n * bs tokens: their mean
        kv_tokens = before + (n + 1) * bs // 2
        busy = gpu_busy_per_step(sched, 8)
        sched.drain()
        floor = decode_read_bytes(cfg, bs, kv_tokens, tp=tp) / bw
        rows.append(
            {
                "batch": bs,
                "step_ms": step * 1e3,
                "floor_ms": floor * 1e3,
                "kv_tokens_per_step": kv_tokens,
                "x_floor": step / floor,
                "gpu_busy_ms": busy * 1e3,
                "gpu_busy_fraction": min(1.0, busy / step),
                "median_step_ms": median * 1e3,
                "longest_step_ms": longest * 1e3,
                "gc_ms": gcs.summary(),
                "draw_graph_steps": draws,
                "host_ms": host.medians_ms(),
            }
        )
        print(
            f"decode bs={bs} {knobs or 'greedy'}: {step * 1e3:.2f} ms/step, floor {floor * 1e3:.2f} ms "
            f"({step / floor:.2f}x), GPU busy {min(1.0, busy / step):.0%} of the step; "
            f"median {median * 1e3:.2f}, longest {longest * 1e3:.2f} ms, "
            f"gc {gcs.summary()}, {draws} drawn in graphs, host {host.medians_ms()}",
            flush=True,
        )
    return rows


def gpu_busy_per_step(sched, n: int) -> float:
    """Seconds of kernel and copy time per steady decode step (CUPTI sees kernels inside
    CUDA graphs); divided by the unprofiled step time, the fraction of wall time the GPU
    is busy."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            sched.step()
        torch.cuda.synchronize()
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return busy_us / 1e6 / n


def bench_ttft(
    engine,
    length: int,
    flops_rate: float,
    cfg: dict[str, Any],
    tp: int,
    matmuls: Matmuls,
    runs: int = 5,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    from baton.common.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts(1, length, seed=99), params)  # warm-up (kernels, JIT)
    times, loaded = [], []
    flops = prefill_flops(cfg, length)
    gc_ms = []
    for s in range(runs):
        p = prompts(1, length, seed=100 + s)
        torch.cuda.synchronize()
        time.sleep(pause_s)  # an idle GPU before the prompt, as a lone request finds it
        with GcPauses() as gcs:
            t = time.perf_counter()
            engine.generate(p, params)
            times.append(time.perf_counter() - t)
        gc_ms.append(gcs.summary())
        time.sleep(pause_s)  # the floor's burst, after the same pause
        loaded.append(flops / (tp * matmuls.rate(flops / tp)))
    ttft, median = min(times), statistics.median(times)
    floor = flops / (tp * flops_rate)
    print(
        f"ttft {length}: {ttft * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms ({ttft / floor:.2f}x); "
        f"median {median * 1e3:.1f} ({median / floor:.2f}x); {pause_s * 1e3:g} ms idle before "
        f"each; runs {' '.join(f'{t * 1e3:.1f}' for t in times)}",
        flush=True,
    )
    print(f"ttft gc: collections per run (generation, ms): {gc_ms}", flush=True)
    best, mid = min(loaded), statistics.median(loaded)
    print(
        f"ttft {length} against the floor under the same load: best {ttft * 1e3:.1f} / "
        f"{best * 1e3:.1f} ms ({ttft / best:.2f}x), median {median * 1e3:.1f} / "
        f"{mid * 1e3:.1f} ({median / mid:.2f}x); floor bursts "
        f"{' '.join(f'{f * 1e3:.1f}' for f in loaded)}",
        flush=True,
    )
    return {
        "prompt_len": length,
        "ttft_ms": ttft * 1e3,
        "floor_ms": floor * 1e3,
        "x_floor": ttft / floor,
        "median_ms": median * 1e3,
        "pause_before_ms": pause_s * 1e3,
        "runs_ms": [t * 1e3 for t in times],
        "gc_pauses_ms": gc_ms,  # per run: (generation, ms) of each collection in it
        "floor_under_load_ms": best * 1e3,
        "floor_under_load_median_ms": mid * 1e3,
        "x_floor_under_load": ttft / best,
        "median_x_floor_under_load": median / mid,
        "floor_under_load_runs_ms": [f * 1e3 for f in loaded],
    }


def bench_offline(engine, n: int, inp: int, out: int) -> dict[str, float]:
    from baton.common.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=out, ignore_eos=True)
    ps = prompts(n, inp, seed=7)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(ps, params)
    dt = time.perf_counter() - t
    tokens = sum(len(o.output_ids) for o in outs)
    print(f"offline {n}x{inp}/{out}: {tokens / dt:.0f} output tok/s ({dt:.1f} s)", flush=True)
    return {
        "prompts": n,
        "input_len": inp,
        "output_len": out,
        "seconds": dt,
        "output_tok_s": tokens / dt,
    }


def bench_hf(path: str, n: int, inp: int, out: int) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts(n, inp, seed=7), device="cuda")
    with torch.no_grad():
        model.generate(ids[:1, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=out,
            min_new_tokens=out,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    tokens = (res.shape[1] - ids.shape[1]) * n
    print(f"transformers {n}x{inp}/{out}: {tokens / dt:.0f} output tok/s ({dt:.1f} s)", flush=True)
    del model
    return {
        "prompts": n,
        "input_len": inp,
        "output_len": out,
        "seconds": dt,
        "output_tok_s": tokens / dt,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_engine.json")
    ap.add_argument("--sections", default="decode,ttft,offline,hf")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--decode-backend", default=None, help="decode's attention, if not the default")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--ttft-runs", type=int, default=5, help="TTFT: the best of this many")
    ap.add_argument(
        "--ttft-pause-ms",
        type=float,
        default=0.0,
        help="TTFT: the GPU idles this long before each prompt (0: back to back, where the "
        "clock falls under the load of the prompts before)",
    )
    ap.add_argument("--offline-prompts", type=int, default=1000)
    ap.add_argument("--hf-prompts", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=0, help="0: from free memory")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--sampling",
        default="greedy",
        help="decode: how requests sample, 'greedy' or e.g. 'temperature=0.7,top_p=0.9'; "
        "several separated by ';' run one after another in the same engine",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs 0..tp-1)")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {
        **run_header("gpu_engine"),
        "backend": args.backend,
        "decode_backend": args.decode_backend,
        "sampling": args.sampling,
        "model": "Llama-3.1-8B config",
    }

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))

    matmuls = Matmuls()  # before the engine takes the GPU's memory for its KV pool
    bw, rate = measure_bandwidth(), measure_matmul(matmuls)
    result["bandwidth_GBps"], result["matmul_TFLOPs"] = bw / 1e9, rate / 1e12
    print(f"bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    cfg = LLAMA_31_8B
    # the KV pool is sized as for one GPU holding everything (what a step reads, plus the
    # embedding table), with or without tensor parallelism
    weight_bytes = decode_read_bytes(cfg, 0, 0) + 2 * cfg["vocab_size"] * cfg["hidden_size"]
    kvb = kv_bytes_per_token(cfg)
    path = model_dir()
    tokens = args.max_total_tokens
    if not tokens:
        free = torch.cuda.mem_get_info()[0] - weight_bytes - 6 * 1024**3
        tokens = int(free // kvb) // 16 * 16
    result["kv_tokens"] = tokens
    save()
    if sections & {"decode", "ttft", "offline"}:
        t = time.perf_counter()
        engine = make_engine(
            path,
            args.backend,
            tokens,
            args.max_running,
            not args.no_graphs,
            args.tp,
            decode_backend=args.decode_backend,
        )
        result["engine_start_s"] = time.perf_counter() - t
        result["gil_switch_interval_s"] = sys.getswitchinterval()
        print(f"engine up in {result['engine_start_s']:.1f} s ({tokens} KV tokens)", flush=True)
        if "decode" in sections:
            result["decode"] = []
            for spec in args.sampling.split(";"):
                for row in bench_decode(
                    engine,
                    [int(b) for b in args.batches.split(",")],
                    args.context,
                    bw,
                    cfg,
                    args.tp,
                    sampling_knobs(spec),
                ):
                    result["decode"].append({**row, "sampling": spec})
                save()
        if "ttft" in sections:
            result["ttft"] = bench_ttft(
                engine,
                args.context,
                rate,
                cfg,
                args.tp,
                matmuls,
                args.ttft_runs,
                args.ttft_pause_ms / 1e3,
            )
            save()
        if "offline" in sections:
            result["offline"] = bench_offline(engine, args.offline_prompts, 1024, 1024)
            save()
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    if "hf" in sections:
        result["hf"] = bench_hf(path, args.hf_prompts, 1024, 1024)
        if "offline" in result:
            result["baton_over_hf"] = (
                result["offline"]["output_tok_s"] / result["hf"]["output_tok_s"]
            )
        save()
    print("\n| figure | value | floor / baseline | ratio |\n|---|---|---|---|")
    for row in result.get("decode", []):
        print(
            f"| decode step, batch {row['batch']}, {args.context} ctx, {row['sampling']} "
            f"| {row['step_ms']:.2f} ms "
            f"| {row['floor_ms']:.2f} ms | {row['x_floor']:.2f}x |"
        )
    if "ttft" in result:
        r = result["ttft"]
        print(
            f"| TTFT, {r['prompt_len']} tokens | {r['ttft_ms']:.1f} ms | {r['floor_ms']:.1f} ms "
            f"| {r['x_floor']:.2f}x |"
        )
        print(
            f"| TTFT, {r['prompt_len']} tokens, median | {r['median_ms']:.1f} ms "
            f"| {r['floor_under_load_median_ms']:.1f} ms under the same load "
            f"| {r['median_x_floor_under_load']:.2f}x |"
        )
    if "offline" in result:
        r = result["offline"]
        hf = result.get("hf", {}).get("output_tok_s")
        ratio = f"{r['output_tok_s'] / hf:.1f}x" if hf else "n/a"
        print(
            f"| offline {r['prompts']}x1024/1024 | {r['output_tok_s']:.0f} tok/s | "
            f"HF {hf or 0:.0f} tok/s | {ratio} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
