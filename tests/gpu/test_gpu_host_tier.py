"""The prefix cache's host tier on CUDA (issue 43): token-exact with it, copies on their
own stream at close to the pinned copy rate, and the thread that queues them never waits.

Written without a GPU (2026-11-28); the first GPU session runs it."""

from __future__ import annotations

import time

import pytest
import torch

from baton.common.cache.host_tier import HostTier
from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_model(model_factory):  # type: ignore[no-untyped-def]
    return model_factory("llama", hidden=256, heads=4, kv_heads=2)


@pytest.mark.parametrize("page", [16, 1])  # 1: scattered pages, gathered through staging
@pytest.mark.parametrize("write", ["on-evict", "through"])
def test_a_burst_through_the_host_tier_equals_the_engine_without_it(gpu_model, write, page) -> None:
    prefixes = random_prompts([200, 240, 180], vocab=2000, seed=1)
    prompts = [
        prefixes[i % 3] + random_prompts([8 + i], vocab=2000, seed=10 + i)[0] for i in range(18)
    ]
    opts = {"device": "cuda", "page_size": page, "attention_backend": "triton"}
    with Engine(gpu_model, max_total_tokens=65536, **opts) as ref:
        expected = [o.output_ids for o in ref.generate(prompts, GREEDY)]
    with Engine(
        gpu_model, max_total_tokens=1024, host_kv_tokens=4096, host_kv_write=write, **opts
    ) as engine:
        got = [o.output_ids for o in engine.generate(prompts, GREEDY)]
        radix = engine.scheduler.cache.radix
        assert radix is not None and radix.tier is not None
        assert radix.tier.buffer.is_pinned()
        counters = radix.tier.counters
        assert counters.hit_tokens > 0 and counters.bytes_to_host > 0
        engine.check_integrity()
        assert engine.all_pages_free() and radix.tier.pages_used == 0
    assert got == expected


def test_loads_reach_70_percent_of_the_pinned_copy_rate_without_blocking_the_caller() -> None:
    """Pages of a Llama-3-8B layout (2 MiB each), every other one, loaded back: the
    issue's target is 70% of one pinned host-to-device copy of the same bytes."""
    pages, page_shape = 512, (32, 2, 16, 8, 128)  # layers, k|v, tokens, kv heads, head dim
    pool = torch.empty((pages, *page_shape), dtype=torch.bfloat16, device="cuda")
    tier = HostTier(pool, pages, write_through=False)
    moved = list(range(0, pages, 2))
    nbytes = len(moved) * tier.page_bytes

    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    device.copy_(host, non_blocking=True)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    reference = nbytes / (time.perf_counter() - start)

    rates = []
    for _ in range(3):
        tier.load(moved, [p + 1 for p in moved], page_size=16)
        moves = tier.take_moves()
        assert moves is not None
        torch.cuda.synchronize()
        start = time.perf_counter()
        moves.run()
        queued = time.perf_counter() - start
        torch.cuda.current_stream().synchronize()
        took = time.perf_counter() - start
        rates.append(nbytes / took)
        assert queued < took / 2, f"run() waited: {queued * 1e3:.2f} of {took * 1e3:.2f} ms"
    best = max(rates)
    print(f"pinned copy {reference / 1e9:.1f} GB/s, tier loads {best / 1e9:.1f} GB/s")
    assert best >= 0.7 * reference


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def test_a_host_tier_pins_what_it_asks_not_the_next_power_of_two() -> None:
    """torch's pinned allocator rounds a block up to a power of two: a 1.5 GiB tier pinned
    2 GiB (and a 40 GiB one 64 GiB, past what the start-up check allowed). Written without
    a GPU (2026-11-28)."""
    page_shape = (32, 2, 16, 8, 128)  # Llama-3-8B's layout: 2 MiB a page in bf16
    pool = torch.randn((4, *page_shape), device="cuda").to(torch.bfloat16)
    before = _available_bytes()
    tier = HostTier(pool, 768, write_through=False)  # 1.5 GiB
    taken = before - _available_bytes()
    assert tier.buffer.is_pinned()
    assert taken < 1.75 * 2**30, f"{taken / 2**30:.2f} GiB taken for a 1.5 GiB tier"
    tier.offload([0, 1], [766, 767])  # the last pages: the whole buffer is usable
    tier.run_queued()
    tier.load([766, 767], [2, 3], page_size=16)
    tier.run_queued()
    assert torch.equal(pool[2:4], pool[0:2])


def test_copies_ahead_run_beside_the_step_and_the_step_taking_their_pages_waits() -> None:
    """Issue 43's offload target (never more than 5% on a decode step): copies of pages
    that stay in the tree, queued ahead of their eviction, do not hold up the step's stream;
    the step that later takes their pages waits for them (the fence). Written without a
    GPU (2026-11-28)."""
    pages, page_shape = 256, (32, 2, 16, 8, 128)  # 2 MiB pages: 512 MiB, ~20 ms to copy
    pool = torch.randn((pages, *page_shape), device="cuda").to(torch.bfloat16)
    tier = HostTier(pool, pages, write_through=False)
    tier.offload(list(range(pages)), list(range(pages)), ahead=True)
    moves = tier.take_moves(launch=1)
    assert moves is not None and moves.wait == 0 and moves.done is not None
    compute = torch.cuda.current_stream()
    moves.run()
    compute.synchronize()
    assert not moves.done.query(), "the step's stream waited for copies ahead"
    tier.fence(1)
    fenced = tier.take_moves(launch=2)
    assert fenced is not None and fenced.fence is moves.done and not fenced.moves
    fenced.run()
    compute.synchronize()
    assert moves.done.query()
    assert torch.equal(tier.buffer[-1], pool[-1].cpu())


def test_scattered_one_token_pages_copy_in_few_operations_near_the_pinned_rate() -> None:
    """Issue 43 at the server's default page of one token (128 KiB of Llama-3-8B's KV):
    a prefill chunk evicting 8,192 scattered pages took 8,192 copies on the forward thread
    and TTFT got worse with the tier. Batched, the step launches a few dozen operations,
    returns before they run, and moves the bytes at half the pinned copy rate or better
    (the gather through the staging buffer costs a device pass). Written without a GPU
    (2026-11-28)."""
    pages, page_shape = 16384, (32, 2, 1, 8, 128)
    pool = torch.randn((pages, *page_shape), device="cuda").to(torch.bfloat16)
    tier = HostTier(pool, pages // 2, write_through=False)
    moved = pages // 2
    nbytes = moved * tier.page_bytes
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    host.copy_(device, non_blocking=True)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    reference = nbytes / (time.perf_counter() - start)

    rng = torch.Generator().manual_seed(0)
    sources = torch.randperm(pages, generator=rng)[:moved].tolist()
    host_pages = tier.allocator.alloc(moved)
    tier.offload(sources, host_pages)
    moves = tier.take_moves()
    assert moves is not None
    torch.cuda.synchronize()
    start = time.perf_counter()
    moves.run()
    queued = time.perf_counter() - start
    torch.cuda.current_stream().synchronize()
    took = time.perf_counter() - start
    print(
        f"pinned copy {reference / 1e9:.1f} GB/s, 8,192 scattered pages to the host "
        f"{nbytes / took / 1e9:.1f} GB/s in {tier.counters.copy_ops} operations, "
        f"queued in {queued * 1e3:.2f} ms"
    )
    assert tier.counters.copy_ops <= 1 + 2 * 16  # 64 MiB chunks of 512 pages
    assert queued < took / 2
    assert nbytes / took >= 0.5 * reference
    assert torch.equal(tier.buffer[host_pages], pool[sources].cpu())

    targets = torch.randperm(pages, generator=rng)[:moved].tolist()
    tier.load(host_pages, targets, page_size=1)
    tier.run_queued()
    assert torch.equal(pool[targets].cpu(), tier.buffer[host_pages])
