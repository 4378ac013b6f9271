"""Offline engine throughput vs transformers' generate(), same model and prompts.

    python -m baton.benchmarks.micro.engine_offline [--model DIR] [--batches 1,8,32]

Prints one table (output tokens/s for baton and transformers at each batch size, and
their ratio) and writes JSON (--out). Greedy, EOS ignored, fixed lengths.
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


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def bench_baton(model: str, prompts: list[list[int]], new: int, **opts: object) -> float:
    from baton.common.engine import Engine
    from baton.common.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    with Engine(model, **opts) as engine:
        engine.generate(prompts[:1], params.replace(max_new_tokens=2))  # warm-up
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        dt = time.perf_counter() - t
    return sum(len(o.output_ids) for o in outs) / dt


def bench_hf(model: str, prompts: list[list[int]], new: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.no_grad():
        hf.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/engine_offline.json")
    args = ap.parse_args(argv)
    if args.model is None:
        from baton.common.models.tiny import default_model_path

        args.model = str(default_model_path())
    from baton.common.config import ModelConfig

    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    rows = []
    for bs in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(bs, args.input_len, vocab, seed=bs)
        opts = {
            "page_size": args.page_size,
            "max_total_tokens": max(8192, bs * (args.input_len + args.output_len) * 2),
        }
        ours = bench_baton(args.model, prompts, args.output_len, **opts)
        ours_sync = bench_baton(args.model, prompts, args.output_len, disable_overlap=True, **opts)
        theirs = bench_hf(args.model, prompts, args.output_len)
        rows.append(
            {
                "batch": bs,
                "baton_tok_s": ours,
                "baton_no_overlap_tok_s": ours_sync,
                "hf_tok_s": theirs,
                "ratio": ours / theirs,
                "ratio_no_overlap": ours_sync / theirs,
            }
        )
    print(
        f"{'batch':>5} {'baton tok/s':>12} {'no overlap':>11} {'HF tok/s':>10} {'baton/HF':>9}"
        f" {'no-ovl/HF':>10}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['baton_tok_s']:>12.1f} {r['baton_no_overlap_tok_s']:>11.1f} "
            f"{r['hf_tok_s']:>10.1f} {r['ratio']:>8.2f}x {r['ratio_no_overlap']:>9.2f}x"
        )
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)",
        "command": "python -m baton.benchmarks.micro.engine_offline " + " ".join(sys.argv[1:]),
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
