"""The host tier's batched copies (issue 43: at a page of one token, a prefill chunk's
evictions were thousands of small copies on the forward thread, and TTFT got worse with
the tier than without it): whatever the pages, a step's copies equal copying page by page
in queue order, and the operations launched do not grow with the number of pages."""

from __future__ import annotations

import math
import random

import pytest
import torch

from baton.common.cache.host_tier import HostTier

LAYERS, HEADS, DIM = 2, 1, 4


def pool(pages: int, page_size: int) -> torch.Tensor:
    """A KV pool's layout, every element distinct."""
    shape = (pages, LAYERS, 2, page_size, HEADS, DIM)
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape)


def tier_for(device: torch.Tensor, host_pages: int, chunk_pages: int) -> HostTier:
    page_bytes = device[0].numel() * device.element_size()
    return HostTier(device, host_pages, write_through=False, staging_bytes=chunk_pages * page_bytes)


def run_step(tier: HostTier) -> None:
    moves = tier.take_moves()
    assert moves is not None
    moves.run()


@pytest.mark.parametrize("page_size", [1, 16])
def test_scattered_pages_reach_the_host_and_come_back_to_other_scattered_pages(page_size) -> None:
    rng = random.Random(page_size)
    device = pool(256, page_size)
    original = device.clone()
    tier = tier_for(device, 256, chunk_pages=7)  # runs span several chunks
    sources = rng.sample(range(256), 100)
    host = rng.sample([*range(150), *range(210, 256)], 40) + list(range(150, 210))  # one run
    tier.offload(sources[:60], host[:60])
    tier.offload(sources[60:], host[60:])  # (one segment with the call before)
    run_step(tier)
    assert torch.equal(tier.buffer[host], original[sources])

    targets = rng.sample(range(256), 100)
    device[targets] = -1
    tier.load(host, targets, page_size)
    run_step(tier)
    assert torch.equal(device[targets], original[sources])
    untouched = sorted(set(range(256)) - set(targets))
    assert torch.equal(device[untouched], original[untouched])


def test_a_step_of_offloads_then_loads_then_offloads_keeps_their_order() -> None:
    """The order the module docstring relies on: a host page read by a load and freed may
    be written by an offload queued after it in the same step; a device page an offload
    read may be written by a load queued after it."""
    device = pool(16, 1)
    original = device.clone()
    tier = tier_for(device, 8, chunk_pages=4)
    tier.offload([3, 9, 5], [0, 1, 2])
    tier.load([1, 0], [3, 12], page_size=1)  # 9 → host 1 → 3 (3 was offloaded just before)
    tier.offload([7, 11], [1, 0])  # host pages 1 and 0 reused once the load read them
    tier.load([2], [7], page_size=1)  # 7 was offloaded just before: it takes 5's KV
    run_step(tier)
    assert torch.equal(device[3], original[9]) and torch.equal(device[12], original[3])
    assert torch.equal(device[7], original[5])
    assert torch.equal(tier.buffer[0], original[11]) and torch.equal(tier.buffer[1], original[7])
    assert torch.equal(tier.buffer[2], original[5])


def test_a_page_written_twice_in_one_segment_holds_the_last_write() -> None:
    device = pool(16, 1)
    original = device.clone()
    tier = tier_for(device, 8, chunk_pages=2)
    tier.offload([1, 2, 3], [4, 5, 6])
    tier.offload([7, 8], [5, 4])  # the host pages dropped and handed out again
    tier.load([0, 1], [10, 11], page_size=1)
    tier.load([2, 3], [11, 10], page_size=1)  # (the host pages of another node)
    tier.buffer[:4] = original[12:16]
    run_step(tier)
    assert torch.equal(tier.buffer[4], original[8]) and torch.equal(tier.buffer[5], original[7])
    assert torch.equal(tier.buffer[6], original[3])
    assert torch.equal(device[10], original[15]) and torch.equal(device[11], original[14])


@pytest.mark.parametrize("seed", range(20))
def test_any_step_equals_copying_page_by_page_in_queue_order(seed) -> None:
    rng = random.Random(seed)
    device = pool(32, rng.choice([1, 2]))
    tier = tier_for(device, 24, chunk_pages=rng.randint(1, 8))
    tier.buffer.copy_(-pool(24, device.shape[3]))
    expected_device, expected_host = device.clone(), tier.buffer.clone()
    for _ in range(rng.randint(1, 8)):
        n = rng.randint(1, 12)
        device_pages = rng.sample(range(32), n)
        start = rng.randrange(24 - n + 1)
        host_pages = (
            list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(24), n)
        )
        if rng.random() < 0.5:
            tier.offload(device_pages, host_pages)
            for d, h in zip(device_pages, host_pages, strict=True):
                expected_host[h] = expected_device[d]
        else:
            tier.load(host_pages, device_pages, page_size=1)
            for d, h in zip(device_pages, host_pages, strict=True):
                expected_device[d] = expected_host[h]
    run_step(tier)
    assert torch.equal(device, expected_device) and torch.equal(tier.buffer, expected_host)


@pytest.mark.parametrize("chunk_pages", [256, 4096])
def test_two_thousand_scattered_single_token_pages_take_a_bounded_number_of_copies(
    chunk_pages,
) -> None:
    """A prefill chunk's evictions at page size 1: one page per token, scattered over the
    device pool, their host pages handed out together. Each host run is a gather and a
    copy per chunk, not a copy per page (before: 2,000 copies each way)."""
    pages = 2000
    device = pool(4096, 1)
    original = device.clone()
    tier = tier_for(device, 4096, chunk_pages)
    sources = random.Random(0).sample(range(4096), pages)
    host = tier.allocator.alloc(pages)
    tier.offload(sources, host)
    run_step(tier)
    bound = 2 * math.ceil(pages / chunk_pages)
    assert tier.counters.copy_ops <= bound
    assert torch.equal(tier.buffer[host], original[sources])

    targets = random.Random(1).sample(range(4096), pages)
    tier.load(host, targets, page_size=1)
    run_step(tier)
    assert tier.counters.copy_ops <= 2 * bound
    assert torch.equal(device[targets], original[sources])


def test_pages_consecutive_on_both_sides_are_one_copy() -> None:
    device = pool(64, 16)
    original = device.clone()
    tier = tier_for(device, 64, chunk_pages=4)
    tier.offload(list(range(10, 30)), list(range(0, 20)))
    tier.offload([40, 41], [30, 31])
    run_step(tier)
    assert tier.counters.copy_ops == 2, "a slice copy per run, however long, no staging"
    assert torch.equal(tier.buffer[:20], original[10:30])
