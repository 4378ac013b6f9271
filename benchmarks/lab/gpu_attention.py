"""flashinfer's attention kernels at the engine's shapes, variant against variant (GPU; a
diagnostic for the engine issue).

    python -m baton.benchmarks.lab.gpu_attention [--batches 1,8,32,128] [--out gpu_attention.json]

Llama-3.1-8B heads (32 query, 8 KV, dim 128), bf16, the KV pool page-major as
the engine lays it out (one page holds every layer's K and V), `--layers` layers so that a
layer's KV is read from HBM, not L2.

- decode, `--context` tokens per request, pages of `--page-size`: the wrapper with tensor
  cores (the prefill kernel), the same in CUDA-graph mode with fixed index buffers as the
  engine's decode graphs build it (flashinfer then always splits the KV and merges the
  parts), CUDA cores, tensor cores with the fa3
  kernel, the split of each request's KV across blocks (none, or fixed sizes), and baton's
  own split-KV Triton kernel (the triton backend's) at 1-16 splits. One CUDA
  graph of every layer's call; µs per layer call and the KV bytes read per second.
- prefill of one `--prompt`-token prompt without a cached prefix, causal: the paged
  wrapper as the engine runs it, against the ragged wrapper that reads K and V where the
  projection left them (contiguous copies, and strided views of one qkv row); ms per layer
  and TFLOP/s of the causal attention.

Every variant's output is compared with the engine's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch

HQ, HK, D = 32, 8, 128
WORKSPACE = 256 * 2**20


def _elapsed(fn: Callable[[], object], reps: int, graph: bool) -> float:
    """Seconds per call of `fn` (best of five runs of `reps` calls)."""
    fn()
    torch.cuda.synchronize()
    run: Callable[[], object]
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    else:

        def run() -> None:
            for _ in range(reps):
                fn()

    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def _pool(tokens: int, layers: int, page: int = 1) -> torch.Tensor:
    """[pages, layers, 2, page, HK, D]: page-major, as `KVPool` lays it out."""
    shape = (-(-tokens // page), layers, 2, page, HK, D)
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)


Variant = Callable[[], Callable[[int], torch.Tensor]]  # builds a call of one layer's attention


def _measure(
    base: dict[str, Any],
    variants: dict[str, Variant],
    layers: int,
    graph: bool,
    rate: Callable[[float], dict[str, float]],
) -> list[dict[str, Any]]:
    """Each variant's row: built, its layer-0 output compared with the first variant's, then
    timed calling layer after layer (`rate(seconds)` adds its rate). A variant that fails
    to build or run is reported, not fatal."""
    rows, ref = [], None
    for name, make in variants.items():
        try:
            fn = make()
            first = fn(0).float()
            ref = first if ref is None else ref
            err = (first - ref).abs().max().item()
            state = {"layer": 0}

            def call(fn=fn, state=state) -> torch.Tensor:
                state["layer"] = (state["layer"] + 1) % layers
                return fn(state["layer"])

            t = _elapsed(call, layers * 2 if graph else layers, graph)
        except Exception as exc:
            rows.append({**base, "variant": name, "error": str(exc)[:200]})
            continue
        rows.append({**base, "variant": name, "us": t * 1e6, **rate(t), "max_abs_err": err})
    return rows


# the partial kernel's launches `--triton-sweep` tries: (keys per block, warps, stages)
SWEEP = [(32, 4, 2), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3),
         (128, 8, 2), (128, 8, 3)]  # fmt: skip


def sweep_splits(bs: int) -> list[int]:
    """Split counts that put about one to four programs per SM (8 KV heads a request)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = max(1, sms // (bs * HK))
    return sorted({max(1, base // 2), base, 2 * base, 4 * base})


def bench_decode(
    bs: int, ctx: int, layers: int, page: int, sweep: bool = False
) -> list[dict[str, Any]]:
    import flashinfer

    from baton.common.attention import triton_kernels

    per_req = -(-ctx // page)
    pool = _pool(bs * per_req * page, layers, page)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(0, bs * per_req + 1, per_req, dtype=torch.int32)
    indices = torch.arange(bs * per_req, dtype=torch.int32, device="cuda")
    last = torch.full((bs,), ctx - (per_req - 1) * page, dtype=torch.int32)
    q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device="cuda")

    def wrapper(wrapper_args: dict[str, Any], plan_args: dict[str, Any]) -> Variant:
        def make() -> Callable[[int], torch.Tensor]:
            args = dict(wrapper_args)
            if args.get("use_cuda_graph"):  # fixed index buffers, as the engine's graphs plan
                for key, n in (
                    ("indptr", bs + 1),
                    ("indices", bs * per_req),
                    ("last_page_len", bs),
                ):
                    args[f"paged_kv_{key}_buffer"] = torch.empty(
                        n, dtype=torch.int32, device="cuda"
                    )
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **args)
            types = {"q_data_type": torch.bfloat16, "kv_data_type": torch.bfloat16}
            w.plan(indptr, indices, last, HQ, HK, D, page, **types, **plan_args)
            return lambda layer: w.run(q, pool[:, layer])

        return make

    # baton's own split-KV kernel (the triton backend's), each request's keys in S splits
    slots = torch.arange(bs * per_req * page, device="cuda").view(bs, per_req * page)
    req_to_token = slots[:, :ctx].contiguous()  # a request's token -> its KV slot
    req_slots = torch.arange(bs, device="cuda")
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")

    def baton(splits: int, config: Any = None) -> Variant:
        def make() -> Callable[[int], torch.Tensor]:
            part_out = torch.empty(bs, HQ, splits, D, dtype=torch.float32, device="cuda")
            part_lse = torch.empty(bs, HQ, splits, dtype=torch.float32, device="cuda")
            out = torch.empty_like(q)

            def run(layer: int) -> torch.Tensor:
                triton_kernels.decode_attention(
                    q, out, pool[:, layer], req_to_token, req_slots, seq_lens, page, D**-0.5,
                    part_out, part_lse, config,
                )  # fmt: skip
                return out

            return run

        return make

    tc: dict[str, Any] = {"use_tensor_cores": True}
    cc: dict[str, Any] = {"use_tensor_cores": False}
    variants: dict[str, Variant] = {
        "tensor cores, graph mode (engine)": wrapper({**tc, "use_cuda_graph": True}, {})
    }
    if sweep:  # the engine's wrapper against the Triton kernel's launches
        for s in sweep_splits(bs):
            for n, w, st in SWEEP:
                cfg = triton_kernels.LaunchConfig(16, n, w, st)
                variants[f"baton triton, {s} splits, {n}/{w}w/{st}s"] = baton(s, cfg)
    else:
        variants |= {
            "tensor cores": wrapper(tc, {}),
            "cuda cores": wrapper(cc, {}),
            "tensor cores, fa3": wrapper({**tc, "backend": "fa3"}, {}),
            "tensor cores, no split": wrapper(tc, {"disable_split_kv": True}),
            "tensor cores, split 256": wrapper(tc, {"fixed_split_size": 256}),
            "tensor cores, split 512": wrapper(tc, {"fixed_split_size": 512}),
            "cuda cores, split 256": wrapper(cc, {"fixed_split_size": 256}),
            **{f"baton triton, {s} splits": baton(s) for s in (1, 2, 4, 8, 16)},
        }
    kv_bytes = bs * ctx * 2 * HK * D * 2
    base = {"op": "decode", "bs": bs, "ctx": ctx, "page": page}
    return _measure(base, variants, layers, True, lambda t: {"TBps": kv_bytes / t / 1e12})


def plan_cost(ws: torch.Tensor, qo: torch.Tensor, common: dict[str, Any]) -> None:
    """Host time of the ragged wrapper's plan (pinned indptr, as the engine passes it),
    and where it goes (cProfile of 50 plans), printed."""
    import cProfile
    import pstats
    import time

    import flashinfer

    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    qo = qo.pin_memory()
    for _ in range(5):
        w.plan(qo, qo, HQ, HK, D, **common)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        w.plan(qo, qo, HQ, HK, D, **common)
    print(f"ragged plan: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms of host time per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        w.plan(qo, qo, HQ, HK, D, **common)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    torch.cuda.synchronize()


def bench_prefill(n: int, layers: int) -> list[dict[str, Any]]:
    import flashinfer

    pool = _pool(n, layers)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    qo = torch.tensor([0, n], dtype=torch.int32)
    indices = torch.arange(n, dtype=torch.int32, device="cuda")
    last = torch.ones(1, dtype=torch.int32)
    # one qkv row per token, as the projection writes it: q heads, k heads, v heads
    qkv = torch.randn(n, (HQ + 2 * HK) * D, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : HQ * D].reshape(n, HQ, D).contiguous()
    k_view = qkv[:, HQ * D : (HQ + HK) * D].view(n, HK, D)
    v_view = qkv[:, (HQ + HK) * D :].view(n, HK, D)
    pool[:, :, 0, 0] = k_view[:, None]
    pool[:, :, 1, 0] = v_view[:, None]
    k, v = k_view.contiguous(), v_view.contiguous()
    common = dict(causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    def paged(backend: str) -> Callable[[int], torch.Tensor]:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo, qo, indices, last, HQ, HK, D, 1, **common)
        return lambda layer: w.run(q, pool[:, layer])

    def ragged(backend: str, strided: bool) -> Callable[[int], torch.Tensor]:
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo, qo, HQ, HK, D, **common)
        kk, vv = (k_view, v_view) if strided else (k, v)
        return lambda layer: w.run(q, kk, vv)

    def sdpa(backend: str, gqa: bool) -> Callable[[int], torch.Tensor]:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
        qq = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, D], strided as the engine's q
        kk, vv = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
        if not gqa:
            kk, vv = (x.repeat_interleave(HQ // HK, dim=1) for x in (kk, vv))

        def run(layer: int) -> torch.Tensor:
            with sdpa_kernel(which):
                o = scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
            return o[0].transpose(0, 1)

        return run

    def single(backend: str, layer: int) -> torch.Tensor:
        return flashinfer.single_prefill_with_kv_cache(
            q, k_view, v_view, causal=True, backend=backend
        )

    variants: dict[str, Variant] = {
        "paged (engine)": lambda: paged("auto"),
        "paged fa2": lambda: paged("fa2"),
        "ragged": lambda: ragged("auto", False),
        "ragged fa2": lambda: ragged("fa2", False),
        "ragged, strided k/v": lambda: ragged("auto", True),
        "single prompt, strided k/v (no plan)": lambda: partial(single, "auto"),
        "single prompt fa3, strided k/v (no plan)": lambda: partial(single, "fa3"),
        "torch sdpa cudnn, gqa": lambda: sdpa("cudnn", True),
        "torch sdpa cudnn, k/v repeated": lambda: sdpa("cudnn", False),
        "torch sdpa flash, gqa": lambda: sdpa("flash", True),
    }
    plan_cost(ws, qo, common)
    flops = 4 * HQ * D * n * (n + 1) / 2  # QKᵀ and PV over the causal triangle
    base = {"op": "prefill", "n": n}
    return _measure(base, variants, layers, False, lambda t: {"TFLOPs": flops / t / 1e12})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16, help="decode's KV page (the engine's)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument(
        "--triton-sweep",
        action="store_true",
        help="decode: the engine's wrapper against baton's Triton kernel at several launches",
    )
    ap.add_argument("--out", default="gpu_attention.json")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "command": "python -m baton.benchmarks.lab.gpu_attention " + " ".join(argv or sys.argv[1:]),
        "rows": [],
    }
    print(
        "| op | size | variant | µs per layer | rate | max abs err |\n|---|---:|---|---:|---:|---:|"
    )
    batches = [int(b) for b in args.batches.split(",")]
    runs: list[Callable[[], list[dict[str, Any]]]] = []
    if not args.no_prefill:
        runs.append(lambda: bench_prefill(args.prompt, args.layers))
    runs += [
        partial(bench_decode, bs, args.context, args.layers, args.page_size, args.triton_sweep)
        for bs in batches
    ]
    for run in runs:
        rows = run()
        torch.cuda.empty_cache()  # the last size's pool
        result["rows"] += rows
        for r in rows:
            size = r.get("bs", r.get("n"))
            if "error" in r:
                print(f"| {r['op']} | {size} | {r['variant']} | failed: {r['error']} | | |")
                continue
            rate = f"{r['TBps']:.2f} TB/s" if "TBps" in r else f"{r['TFLOPs']:.0f} TFLOP/s"
            print(
                f"| {r['op']} | {size} | {r['variant']} | {r['us']:.1f} | {rate} | "
                f"{r['max_abs_err']:.3g} |",
                flush=True,
            )
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
