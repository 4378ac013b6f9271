"""What a prefix found on the host tier is worth against one found on the device: the
router's `HOST_HIT_VALUE`, measured (issue 43).

    python -m baton.benchmarks.lab.gpu_host_hit [--prefixes 1024,4096,12288]
        [--suffixes 256,2048] [--runs 3] [--page-size 1] [--out host_hit.json]
    python -m baton.benchmarks.lab.gpu_host_hit --device cpu --model DIR --prefixes 32 ...

One engine as `gpu_engine` builds it (Llama-3.1-8B's shape, random weights, flashinfer,
CUDA graphs, overlap, the server's defaults of page size 1 and no prompt chunking), with
a host tier. For each prefix length P and suffix length S, the time from `generate` to
the first token of a prompt of P + S tokens, in three arms, each --runs times on fresh
tokens (medians):

- `none`: nothing of it cached, P + S tokens computed;
- `device`: P cached on the device (a prompt of P and another suffix ran just before),
  S computed;
- `host`: P cached on the host tier only (as `device`, then every cached page evicted to
  the host through the tree's eviction), P's pages loaded back, S computed.

A host hit's value is `(none - host) / (none - device)`: the share of a device hit's
saving a host hit keeps, 1 when loading costs nothing, 0 when it costs as much as
computing. Printed per (P, S), with the bytes loaded and the load rate the run saw (bytes
over the load stall the forward waited for); JSON with --out. Before the timed runs each
arm runs once untimed (kernel compiles for its shapes).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch

from baton.benchmarks.lab.gpu_setup import make_engine, markdown_table, model_dir
from baton.common.cache.kv_pool import KVPool
from baton.common.config import ModelConfig
from baton.common.sampling import SamplingParams

ARMS = ("none", "device", "host")


class Arms:
    """Times one prompt's first token with its prefix cached nowhere, on the device, or
    on the host tier."""

    def __init__(self, engine: Any, vocab: int, seed: int) -> None:
        self.engine = engine
        self.radix = engine.scheduler.cache.radix
        self.counters = self.radix.tier.counters
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def run(self, arm: str, prefix: int, suffix: int) -> dict[str, float]:
        """One timed prompt of the arm: seconds to its first token, tokens found cached,
        bytes loaded from the host and the load stall."""
        self.radix.drop_unlocked()  # a clean slate on both tiers
        head = self.tokens(prefix)
        if arm != "none":
            self.engine.generate([head + self.tokens(suffix)], self.params)
        if arm == "host":
            self.radix.evict(self.radix.evictable_pages)  # every cached page to the host
            self.radix.tier.run_queued()
        sync()
        loaded, stall = self.counters.bytes_to_device, self.counters.load_stall_seconds
        started = time.perf_counter()
        out = self.engine.generate([head + self.tokens(suffix)], self.params)[0]
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "cached": float(out.cached_tokens),
            "loaded_bytes": float(self.counters.bytes_to_device - loaded),
            "stall_s": self.counters.load_stall_seconds - stall,
        }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(arms: Arms, prefix: int, suffix: int, runs: int) -> dict[str, Any]:
    for arm in ARMS:  # untimed: this shape's kernels
        arms.run(arm, prefix, suffix)
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for _ in range(runs):
        for arm in ARMS:  # interleaved, so a drift of the clocks reaches every arm
            samples[arm].append(arms.run(arm, prefix, suffix))
    ms = {arm: statistics.median(s["seconds"] for s in samples[arm]) * 1e3 for arm in ARMS}
    saved = ms["none"] - ms["device"]
    host = samples["host"]
    loaded = statistics.median(s["loaded_bytes"] for s in host)
    stall = statistics.median(s["stall_s"] for s in host)
    row = {
        "prefix": prefix,
        "suffix": suffix,
        **{f"{arm}_ms": ms[arm] for arm in ARMS},
        "cached_device": min(s["cached"] for s in samples["device"]),
        "cached_host": min(s["cached"] for s in host),
        "loaded_mib": loaded / 2**20,
        "load_stall_ms": stall * 1e3,
        "load_gb_per_s": loaded / stall / 1e9 if stall > 0 else 0.0,
        "value": (ms["none"] - ms["host"]) / saved if saved > 0 else float("nan"),
    }
    print(
        f"host hit P={prefix} S={suffix}: none {ms['none']:.1f} ms, device {ms['device']:.1f} "
        f"ms, host {ms['host']:.1f} ms ({row['loaded_mib']:.0f} MiB loaded, stall "
        f"{row['load_stall_ms']:.1f} ms): value {row['value']:.3f}",
        flush=True,
    )
    return row


TABLE = [
    ("prefix", "prefix", "d"), ("suffix", "suffix", "d"), ("none ms", "none_ms", ".1f"),
    ("device ms", "device_ms", ".1f"), ("host ms", "host_ms", ".1f"),
    ("MiB loaded", "loaded_mib", ".0f"), ("load stall ms", "load_stall_ms", ".1f"),
    ("GB/s", "load_gb_per_s", ".1f"), ("value", "value", ".3f"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", default="1024,4096,12288", help="cached prefix lengths")
    ap.add_argument("--suffixes", default="256,2048", help="uncached suffix lengths")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=1, help="tokens a page (server: 1)")
    ap.add_argument("--chunk", type=int, help="--chunked-prefill-size (server: none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", help="a model folder (default: Llama-3.1-8B's shape)")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    suffixes = [int(s) for s in args.suffixes.split(",")]
    cuda = args.device == "cuda"
    longest = max(prefixes) + max(suffixes)
    pool = 3 * longest + 1024  # the cached prompt, the timed one and room: nothing evicted
    path = args.model or model_dir()
    dtype = torch.bfloat16 if cuda else torch.float32
    m = ModelConfig.from_pretrained(path)
    token_bytes = KVPool.token_bytes(m.num_layers, m.num_kv_heads, m.head_dim, dtype)
    engine = make_engine(
        path,
        args.backend if cuda else "torch",
        pool,
        8,
        cuda,
        overlap=True,
        host_kv_tokens=2 * longest,
        page_size=args.page_size,
        chunked_prefill_size=args.chunk,
        max_prefill_tokens=max(16384, longest),
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
    )
    device = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    print(
        f"engine: {device}, pool {pool} tokens, page {args.page_size}, "
        f"{token_bytes / 2**10:.0f} KiB of KV a token, chunk {args.chunk or 'none'}",
        flush=True,
    )
    arms = Arms(engine, engine.model_config.vocab_size, seed=7)
    rows = [measure(arms, p, s, args.runs) for p in prefixes for s in suffixes]
    engine.scheduler.cache.radix.drop_unlocked()
    engine.check_integrity()
    engine.shutdown()
    print(markdown_table(rows, TABLE))
    values = [r["value"] for r in rows if r["value"] == r["value"]]
    if values:
        print(f"host hit value: median {statistics.median(values):.3f}, least {min(values):.3f}")
    if args.out:
        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": device,
            "command": " ".join(sys.argv),
            "page_size": args.page_size,
            "token_bytes": token_bytes,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
