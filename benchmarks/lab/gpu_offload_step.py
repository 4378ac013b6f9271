"""What GPU→host offload adds to a decode step (issue 43's target: never more than 5%).

    python -m baton.benchmarks.lab.gpu_offload_step [--batches 1,32,128] [--ctx 4096]
        [--rates growth,16,64] [--page-size 16] [--out offload_step.json]
    python -m baton.benchmarks.lab.gpu_offload_step --page-size 1 --rates growth,1024,8192
    python -m baton.benchmarks.lab.gpu_offload_step --device cpu --model DIR --ctx 64 ...

One engine as `gpu_engine` builds it (Llama-3.1-8B's shape, random weights, flashinfer,
CUDA graphs, overlap), with a host tier of --host-gib. For each batch size, `bs` requests
of --ctx tokens decode steadily while blocks of --block steps take turns, --rounds times:
a block without offload, then a block at each rate of offload (pages per step; `growth`
is the batch's own page growth, bs / page size: what its new pages would evict from a
full pool). Before each step of an offload block, on the scheduler thread, the tree is
made to evict that many pages through `CacheManager.ensure_free` (the path a request's
page allocation takes: LRU eviction, a host page for each, an LRU drop on the host once
it is full, the queued copy), and the freed pages go back into the tree as a new cached
prefix, so the next step has as many to evict. The copies then run as in serving: on the
tier's stream, those of pages copied ahead of eviction (at each launch, sized by the
evictions of the last launches) beside the forward, which waits only for copies queued
on demand and fences on the earlier ones whose pages it takes. Every block starts from a
tree without stock (the plain blocks copy nothing ahead), and its first 2 steps (`SETTLE`)
are not timed. `--page-size 1` (the server's default) makes a page one token, so the
pages a step evicts are many and scattered: what a prefill chunk's evictions look like in
serving (issue 43's replay: 8k tokens a chunk), where the copies must not cost a
launch per page; give it rates of that size (pages a step).

A step's time is the wall time between two `Scheduler.step` calls returning (steady
state under overlap: the period of the loop), the hook's host time included. Printed per
batch and rate: median and p90 step, their ratio to the blocks without offload, pages
evicted per step, bytes copied to the host per step and their rate, the copies the
forwards waited for per step (`wait ms`, from the tier's stall counter), the copy
operations launched per step (`ops`: slice copies, gather/scatter kernels and index
uploads, `cache/page_moves.py`), the eviction's host time per step (`hook ms`: the
tree's walk, the host allocation and drop, the queued copy; the copies ahead are queued
at launch, inside `Scheduler.step`). Writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from baton.benchmarks.lab.gpu_setup import make_engine, markdown_table, model_dir
from baton.common.cache.kv_pool import KVPool
from baton.common.config import ModelConfig

# untimed steps after a block's stock is cached: a page is copied ahead of its eviction two
# launches after it came in (computed by then); in serving the least recently used pages
# are old, the stock is not
SETTLE = 2


class Offloader:
    """Evicts `rate` pages of cached prefixes before each step and refills the tree with
    the freed pages (fresh tokens, unlocked): a steady stream of offloads through the
    engine's own eviction path."""

    def __init__(self, sched, vocab: int, seed: int) -> None:
        self.cache = sched.cache
        self.radix = sched.cache.radix
        self.page = sched.cache.page_size
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.host_seconds: list[float] = []
        self.evicted = 0

    def start_block(self, rate: int, nodes: int = 4) -> None:
        """Offload every cached prefix now (outside the timing) and cache `nodes` new ones of
        `rate` pages each: the block's evictions are then of `rate` pages exactly."""
        self.radix.evict(self.radix.evictable_pages)
        self.radix.tier.run_queued()
        for _ in range(nodes if rate else 0):
            self._insert(self.cache.allocator.alloc(rate))

    def fill_host(self, node_tokens: int = 256) -> None:
        """Fill the host tier with evicted prefixes of `node_tokens` tokens, so that timed
        offloads also make room on the host, dropping its least recently used leaves (its
        steady state in a long-running server)."""
        tier = self.radix.tier
        node_pages = max(node_tokens // self.page, 1)
        while tier.pages_used + node_pages <= tier.num_pages:
            self._insert(self.cache.allocator.alloc(node_pages))
            self.cache.ensure_free(self.cache.allocator.num_free + node_pages)
            tier.run_queued()

    def before_step(self, rate: int) -> None:
        """The eviction (timed: the offload path's host work) and the refill (not: this
        benchmark's own, though in the step time too, kept cheap)."""
        started = time.perf_counter()
        free = self.cache.allocator.num_free
        self.cache.ensure_free(free + rate)  # evicts >= `rate` pages (LRU): their copies queue
        self.host_seconds.append(time.perf_counter() - started)
        self.evicted += self.cache.allocator.num_free - free
        self._insert(self.cache.allocator.alloc(self.cache.allocator.num_free - free))

    def _insert(self, pages: list[int]) -> None:
        tokens = self.rng.integers(1, self.vocab, len(pages) * self.page).tolist()
        already = self.radix.insert(tokens, pages)
        assert already == 0, "a stock prefix the tree held already"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rate_pages(rate: str, bs: int, page: int) -> int:
    return max(1, -(-bs // page)) if rate == "growth" else int(rate)


def bench_batch(
    engine, bs: int, ctx: int, rates: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    from baton.common.sampling import SamplingParams

    sched = engine.scheduler
    radix = sched.cache.radix
    tier = radix.tier
    page = sched.cache.page_size
    vocab = engine.model_config.vocab_size
    steps = args.rounds * (args.block + SETTLE) * (1 + len(rates)) + args.warmup
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
    # a clean slate: an earlier batch's cached prompts would be evicted (and offloaded) by
    # this batch's growth, in the blocks without offload too
    sched.cache.drop_unlocked()
    rng = random.Random(bs)
    for i in range(bs):
        sched.add_request(f"d{bs}-{i}", [rng.randrange(1, vocab) for _ in range(ctx)], params)
    while len(sched.prefill) or any(len(r.output_ids) < 2 for r in sched.decode.running):
        sched.step()
    offloader = Offloader(sched, vocab, seed=10**6 + bs)  # tokens of its own, not the prompts'
    offloader.fill_host()
    pages = {r: rate_pages(r, bs, page) for r in rates}
    for _ in range(args.warmup):
        sched.step()
    if torch.cuda.is_available() and engine.config.device == "cuda":
        torch.cuda.synchronize()
    arms = ["none", *rates]
    times: dict[str, list[float]] = {a: [] for a in arms}
    hook: dict[str, list[float]] = {a: [] for a in arms}
    moved: dict[str, int] = dict.fromkeys(arms, 0)
    evicted: dict[str, int] = dict.fromkeys(arms, 0)
    waited: dict[str, float] = dict.fromkeys(arms, 0.0)
    ops: dict[str, int] = dict.fromkeys(arms, 0)
    for _, arm in itertools.product(range(args.rounds), arms):
        offloader.host_seconds, offloader.evicted = [], 0
        offloader.start_block(pages.get(arm, 0))
        for _ in range(SETTLE):
            sched.step()
        mark = time.perf_counter()  # (one step is shorter: the median is the figure)
        to_host, stall = tier.counters.bytes_to_host, tier.counters.load_stall_seconds
        launched = tier.counters.copy_ops
        for _ in range(args.block):
            if arm != "none":
                offloader.before_step(pages[arm])
            sched.step()
            now = time.perf_counter()
            times[arm].append(now - mark)
            mark = now
        moved[arm] += tier.counters.bytes_to_host - to_host
        evicted[arm] += offloader.evicted
        waited[arm] += tier.counters.load_stall_seconds - stall  # (CUDA: harvested late)
        ops[arm] += tier.counters.copy_ops - launched
        hook[arm].extend(offloader.host_seconds)
    sched.drain()
    base_median = statistics.median(times["none"])
    base_p90 = percentile(times["none"], 0.9)
    rows = []
    for arm in arms:
        t = times[arm]
        median, p90 = statistics.median(t), percentile(t, 0.9)
        per_step = moved[arm] / len(t)
        row = {
            "batch": bs,
            "ctx": ctx,
            "offload": arm,
            "pages_per_step": evicted[arm] / len(t),
            "steps": len(t),
            "median_ms": median * 1e3,
            "p90_ms": p90 * 1e3,
            "median_ratio": median / base_median,
            "p90_ratio": p90 / base_p90,
            "mib_per_step": per_step / 2**20,
            "gb_per_s": per_step / median / 1e9,
            "wait_ms": waited[arm] / len(t) * 1e3,
            "ops_per_step": ops[arm] / len(t),
            "hook_ms": statistics.median(hook[arm]) * 1e3 if hook[arm] else 0.0,
        }
        rows.append(row)
        print(
            f"offload bs={bs} ctx={ctx} {arm:>6} ({row['pages_per_step']:.1f} pages/step, "
            f"{row['mib_per_step']:.1f} MiB, {row['gb_per_s']:.2f} GB/s): median "
            f"{row['median_ms']:.2f} ms ({row['median_ratio']:.3f}x), p90 {row['p90_ms']:.2f} "
            f"ms ({row['p90_ratio']:.3f}x), wait {row['wait_ms']:.3f} ms, "
            f"{row['ops_per_step']:.1f} ops, hook {row['hook_ms']:.3f} ms",
            flush=True,
        )
    return rows


TABLE = [
    ("batch", "batch", "d"), ("offload", "offload", ""), ("pages/step", "pages_per_step", ".1f"),
    ("MiB/step", "mib_per_step", ".1f"), ("GB/s", "gb_per_s", ".2f"),
    ("step median ms", "median_ms", ".2f"), ("x none", "median_ratio", ".3f"),
    ("step p90 ms", "p90_ms", ".2f"), ("x none", "p90_ratio", ".3f"),
    ("wait ms", "wait_ms", ".3f"), ("ops", "ops_per_step", ".1f"), ("hook ms", "hook_ms", ".3f"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--ctx", type=int, default=4096, help="tokens of context per request")
    ap.add_argument("--rates", default="growth,16,64", help="pages offloaded per step")
    ap.add_argument("--block", type=int, default=16, help="steps per block")
    ap.add_argument("--rounds", type=int, default=6, help="turns of the blocks")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--host-gib", type=float, default=16.0, help="the host tier's size")
    ap.add_argument(
        "--page-size", type=int, default=16, help="tokens a page (the server's default: 1)"
    )
    ap.add_argument(
        "--write",
        default="on-evict",
        choices=["on-evict", "through"],
        help="--host-kv-write; through: evictions copy nothing, the refilled prefixes are "
        "copied two launches later, and the plain blocks copy the batch's own new pages",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", help="a model folder (default: Llama-3.1-8B's shape)")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    rates = args.rates.split(",")
    cuda = args.device == "cuda"
    steps = args.rounds * (args.block + SETTLE) * (1 + len(rates)) + args.warmup + 16
    page = args.page_size
    stock = 4 * max(rate_pages(r, max(batches), page) for r in rates) * len(rates) * page
    pool = max(batches) * (args.ctx + steps + 2 * page) + stock + 256 * page
    path = args.model or model_dir()
    dtype = torch.bfloat16 if cuda else torch.float32
    m = ModelConfig.from_pretrained(path)
    page_bytes = page * KVPool.token_bytes(m.num_layers, m.num_kv_heads, m.head_dim, dtype)
    host_tokens = int(args.host_gib * 2**30 // page_bytes) * page
    engine = make_engine(
        path,
        args.backend if cuda else "torch",
        pool,
        max(batches),
        cuda,
        overlap=True,
        host_kv_tokens=host_tokens,
        host_kv_write=args.write,
        page_size=page,
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
    )
    device = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    print(
        f"engine: {device}, pool {pool} tokens, host tier {host_tokens} tokens "
        f"({host_tokens // page * page_bytes / 2**30:.1f} GiB), page {page} tokens "
        f"({page_bytes / 2**20:.2f} MiB), write {args.write}",
        flush=True,
    )
    rows = [row for bs in batches for row in bench_batch(engine, bs, args.ctx, rates, args)]
    counters = engine.scheduler.cache.radix.tier.counters
    print(f"host tier: {counters}", flush=True)
    engine.check_integrity()
    engine.shutdown()
    print(markdown_table(rows, TABLE))
    if args.out:
        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": device,
            "command": " ".join(sys.argv),
            "pool_tokens": pool,
            "host_tier_tokens": host_tokens,
            "host_kv_write": args.write,
            "page_size": page,
            "page_bytes": page_bytes,
            "rows": rows,
            "tier_counters": dataclasses.asdict(counters),
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
