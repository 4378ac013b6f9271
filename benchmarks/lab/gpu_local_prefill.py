"""What a decode worker computes of prompts itself while it keeps its TPOT (a diagnostic):
one GPU, a decode worker's scheduler and role alone.

    python -m baton.benchmarks.lab.gpu_local_prefill [--batches 64,128] [--tpot-slo 0.015]

Issue 38's lever, and issue 40's `local` placement: a decode worker with B requests
decoding (context --context) is handed prompts of --prompt-len tokens to compute itself
(a request without a room), one always waiting, for --seconds. Its role bounds each step's
prompt chunk by its running requests' TPOT slack (`decode_role.prefill_budget`), so what it
computes is what the SLO leaves. For each B, with the piecewise graphs (`pieces`) and with
the same steps launched layer by layer (`eager`), side by side on one engine: prompt tokens
computed a second, the running requests' mean time per token, the share of steps that
computed a prompt chunk, and the median of those steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from typing import Any

from baton.benchmarks.lab.gpu_setup import markdown_table, model_dir, prompts, run_header


class Samples:
    """Every step the scheduler's clock records (tokens, rows, seconds, attention pairs), with
    the phase it came in: what the decode-step fit learns from, to study it offline."""

    def __init__(self, clock) -> None:
        self.phase = ""
        self.rows: list[tuple[str, int, int, float, float]] = []
        record = clock.record

        def recorded(tokens: int, rows: int, seconds: float, pairs: float = 0.0) -> None:
            self.rows.append((self.phase, tokens, rows, seconds, pairs))
            record(tokens, rows, seconds, pairs)

        clock.record = recorded


class Counts:
    """The role's output sink: tokens each request produced so far."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.done: set[str] = set()

    def __call__(self, req, tokens, lps, finished) -> None:
        self.tokens[req.rid] = self.tokens.get(req.rid, 0) + len(tokens)
        if finished:
            self.done.add(req.rid)

    def take(self) -> None:  # (the warm-up's collector interface)
        return None


def build(args: argparse.Namespace):
    from baton.common.config import EngineConfig, ModelConfig, TransferConfig
    from baton.common.disagg.start import start_role
    from baton.services.worker import warm_up

    path = args.model or model_dir()
    cfg = EngineConfig(
        model_path=path,
        role="decode",
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        load_format="dummy",
        attention_backend=args.backend,
        page_size=16,
        max_total_tokens=args.pool_tokens,
        max_running_requests=256,
        cuda_graph_max_bs=256,
        prefill_graph_max_tokens=0,
        piecewise_graph_max_tokens=args.piecewise_max_tokens,
        tpot_slo=args.tpot_slo,
    )
    sink = Counts()
    sched, role = start_role(
        "decode", cfg, ModelConfig.from_pretrained(path), sink, TransferConfig(backend="tcp")
    )
    warm_up.warm_up(sched, sink)  # (which ends with a fresh clock)
    return sched, role, sink, Samples(sched.clock)


def step(sched, role) -> None:
    role.poll()
    if sched.has_work():
        sched.step()
    role.poll()


def run(sched, role, sink, bs: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    from baton.common.protocol import GenerateReq
    from baton.common.sampling import SamplingParams

    decoding = SamplingParams(temperature=0.0, max_new_tokens=args.decode_len, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    seed = 1000 * bs + len(tag)
    slo = role.tpot_slo
    role.tpot_slo = 10.0  # the decoders come in at once: their own prompts are no test
    vocab = sched.model_cfg.vocab_size

    def fresh(n: int, length: int, seed: int) -> list[list[int]]:  # within any vocabulary
        return [[t % vocab for t in p] for p in prompts(n, length, seed)]

    # (made before the decoders: a second of Python between their steps stretches a step
    # the clock measures)
    queue = iter(fresh(2_000, args.prompt_len, seed + 1))
    decoders = [f"{tag}-d{i}" for i in range(bs)]
    for rid, p in zip(decoders, fresh(bs, args.context, seed), strict=True):
        role.on_generate(GenerateReq(rid, p, decoding))
    while any(sink.tokens.get(rid, 0) < 2 for rid in decoders):
        if sink.done.intersection(decoders):
            raise RuntimeError(f"a decoding request ended: {sink.done.intersection(decoders)}")
        step(sched, role)
    role.tpot_slo = slo
    launches: list[tuple[float, int, int]] = []  # (time, prompt tokens, decode rows)
    launch = sched._launch

    def counted(batch):
        chunk = sum(it.extend_len for it in batch.items if it.extend_len > 1 or not it.sample)
        rows = sum(1 for it in batch.items if it.extend_len == 1 and it.sample)
        launches.append((time.perf_counter(), chunk, rows))
        return launch(batch)

    sched._launch = counted
    plans = []  # the slack rule's view at each step (`DecodeRole.plan`)
    made = 0
    before = {rid: sink.tokens[rid] for rid in decoders}
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < args.seconds:
            waiting = made - sum(1 for i in range(made) if f"{tag}-p{i}" in sink.done)
            while waiting < 2:  # one always waiting behind the one being computed
                role.on_generate(GenerateReq(f"{tag}-p{made}", next(queue), one))
                made, waiting = made + 1, waiting + 1
            step(sched, role)
            plans.append(role.plan)
        took = time.perf_counter() - start
        produced = [sink.tokens[rid] - before[rid] for rid in decoders]
    finally:
        sched._launch = launch
    for rid in [*decoders, *(f"{tag}-p{i}" for i in range(made))]:
        role.on_abort(rid)
    while sched.has_work() or role.has_work():
        step(sched, role)
    # Overlapped, step i+2 is launched once step i's results are in: the gap between the
    # launches of steps i+1 and i+2 is step i's time on the GPU
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(launches)]
    steps = list(zip(launches, gaps[1:], strict=False))
    mixed = [g for (_, chunk, _), g in steps if chunk]
    decode = [g for (_, chunk, _), g in steps if not chunk]
    return {
        "mode": tag.split("-")[0],
        "batch": bs,
        "prompt_tok_s": sum(chunk for _, chunk, _ in launches) / took,
        "tpot_ms": 1e3 * took / statistics.mean(produced),
        "mixed_share": len(mixed) / max(len(steps), 1),
        "mixed_step_ms": 1e3 * statistics.median(mixed) if mixed else float("nan"),
        "decode_step_ms": 1e3 * statistics.median(decode) if decode else float("nan"),
        "prompts": made,
        "predicted_decode_ms": 1e3 * statistics.median(p.decode_step for p in plans),
        "slack_s": statistics.median(p.least_slack for p in plans),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", type=int, default=1460)
    ap.add_argument("--prompt-len", type=int, default=1330)
    ap.add_argument(
        "--decode-len",
        type=int,
        default=100_000,
        help="the decoding requests' max_new_tokens: the slack rule plans their TPOT to it",
    )
    ap.add_argument("--tpot-slo", type=float, default=0.015)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--piecewise-max-tokens", type=int, default=1024)
    ap.add_argument("--pool-tokens", type=int, default=400_000)
    ap.add_argument("--model", default="", help="a model folder (default: the 8B shape)")
    ap.add_argument("--device", default="cuda", help="cpu: to try it with a small --model")
    ap.add_argument("--out", default="gpu_local_prefill.json")
    args = ap.parse_args(argv)
    header = run_header("gpu_local_prefill") if args.device == "cuda" else {"device": "cpu"}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sched, role, sink, samples = build(args)
    pieces = sched.runner.piecewise_graphs
    rows = []
    for bs in (int(b) for b in args.batches.split(",")):
        for mode in ("pieces", "eager") if pieces is not None else ("eager",):
            sched.runner.piecewise_graphs = pieces if mode == "pieces" else None
            samples.phase = f"{mode}-{bs}"
            row = run(sched, role, sink, bs, args, f"{mode}-{bs}")
            rows.append(row)
            print(
                f"{mode}, batch {bs}: {row['prompt_tok_s']:.0f} prompt tok/s, TPOT "
                f"{row['tpot_ms']:.2f} ms, {100 * row['mixed_share']:.0f}% of steps mixed "
                f"({row['mixed_step_ms']:.2f} ms; decode {row['decode_step_ms']:.2f}, predicted "
                f"{row['predicted_decode_ms']:.2f}; least slack {row['slack_s']:.3f} s)",
                flush=True,
            )
            with open(args.out, "w") as f:
                json.dump({**header, "rows": rows, "clock_samples": samples.rows}, f)
    sched.runner.piecewise_graphs = pieces
    print()
    print(
        markdown_table(
            rows,
            [
                ("mode", "mode", ""),
                ("batch", "batch", "d"),
                ("prompt tok/s", "prompt_tok_s", ".0f"),
                ("TPOT ms", "tpot_ms", ".2f"),
                ("steps mixed", "mixed_share", ".0%"),
                ("mixed step ms", "mixed_step_ms", ".2f"),
                ("decode step ms", "decode_step_ms", ".2f"),
                ("prompts", "prompts", "d"),
                ("predicted decode ms", "predicted_decode_ms", ".2f"),
                ("least slack s", "slack_s", ".3f"),
            ],
        )
    )
    role.shutdown()
    sched.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
