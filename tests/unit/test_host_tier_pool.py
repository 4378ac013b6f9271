"""The host tier's pool keeps its size and its room: pinned by registering its own memory
(torch's pinned allocator rounds a block up to a power of two) and unregistered when it
goes; when full, one LRU drop frees a 64th of it, so the evictions that follow find room
without dropping again (a drop walked the whole tree on the scheduler thread: 0.5 ms with
1,024 host nodes, 1.5 ms with 4,000; it now takes from a heap kept across drops, and drops
what the walk dropped)."""

from __future__ import annotations

import heapq
import random

import pytest
import torch

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.host_tier import HostTier
from baton.common.cache.radix import RadixNode
from baton.common.cache.tiered_radix import DROP_AHEAD, TieredRadixCache

PAGE = 2
HOST_PAGES = 256


def test_a_full_host_tier_drops_a_share_ahead_and_then_offloads_without_dropping() -> None:
    allocator = PageAllocator(8)
    tier = HostTier(torch.zeros((8, PAGE, 4)), HOST_PAGES, write_through=False)
    radix = TieredRadixCache(PAGE, allocator.free, tier)
    tokens = iter(range(10**6))

    def cache_and_evict_one_page() -> None:
        radix.insert([next(tokens) for _ in range(PAGE)], allocator.alloc(1))
        radix.evict(1)
        tier.run_queued()

    for _ in range(HOST_PAGES):
        cache_and_evict_one_page()
    assert tier.pages_used == HOST_PAGES and tier.counters.dropped_pages == 0

    cache_and_evict_one_page()  # the host is full: it drops the least recently used first
    ahead = HOST_PAGES // DROP_AHEAD
    assert tier.counters.dropped_pages == ahead
    for _ in range(ahead - 1):  # room for these was made by that one drop
        cache_and_evict_one_page()
    assert tier.counters.dropped_pages == ahead
    assert tier.pages_used == HOST_PAGES
    radix.check_integrity()
    assert len(radix.owned_pages()) == 0 and allocator.num_free == 8


class FakeCudart:
    """torch.cuda.cudart()'s registering calls, recorded (the CPU build has none)."""

    class cudaError:  # the binding's names
        success = 0
        invalid_value = 1

    def __init__(self, answer: int, unregister_answer: int = 0) -> None:
        self.answer = answer
        self.unregister_answer = unregister_answer
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        return self.answer

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return self.unregister_answer

    def cudaGetErrorString(self, code: int) -> str:
        return f"error {code}"


def test_a_pinned_host_pool_is_registered_and_unregistered_once_it_goes(monkeypatch) -> None:
    """The pool is pinned by registering its own memory (torch's pinned allocator would
    round 1.5 GiB up to 2), and unregistered when the pool goes, before it is freed."""
    import gc

    from baton.common.cache import host_tier

    fake = FakeCudart(FakeCudart.cudaError.success)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    buffer = host_tier._host_buffer((3, 5), torch.float32, pinned=True)
    ptr = buffer.data_ptr()
    assert buffer.shape == (3, 5) and fake.calls == [("register", ptr)]
    del buffer
    gc.collect()
    assert fake.calls == [("register", ptr), ("unregister", ptr)]


def test_a_failed_unregistering_is_logged_and_taken_off_the_thread(monkeypatch, caplog) -> None:
    """CUDA keeps a failed call's error as its thread's last one, and torch's next kernel
    on that thread reports it as its own; the finalizer runs on whichever thread collects
    the pool (a forward thread). The failure is logged and its error taken."""
    import gc

    from baton.common import devices
    from baton.common.cache import host_tier

    fake = FakeCudart(FakeCudart.cudaError.success, FakeCudart.cudaError.invalid_value)
    taken: list[bool] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(devices, "take_cuda_error", lambda: taken.append(True) or "")
    buffer = host_tier._host_buffer((3, 5), torch.float32, pinned=True)
    with caplog.at_level("WARNING", logger=host_tier.__name__):
        del buffer
        gc.collect()
    assert taken == [True]
    assert "unregistering its pool failed: error 1" in caplog.text


def walked_drops(radix: TieredRadixCache, num_pages: int) -> list[RadixNode]:
    """The nodes a drop of `num_pages` takes, found by a walk of the whole tree."""
    heap = [n for n in radix.all_nodes() if radix._droppable(n)]
    heapq.heapify(heap)
    out, freed, gone = [], 0, set()
    while freed < num_pages and heap:
        node = heapq.heappop(heap)
        out.append(node)
        freed += len(node.host)
        gone.add(node)
        parent = node.parent
        if node.pages or parent is radix.root or parent is None or parent.pages:
            continue
        if parent.lock_ref == 0 and all(c in gone for c in parent.children.values()):
            heapq.heappush(heap, parent)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_a_drop_takes_the_least_recently_used_as_a_walk_of_the_tree_would(seed) -> None:
    rng = random.Random(seed)
    allocator = PageAllocator(64)
    tier = HostTier(torch.zeros((64, PAGE)), 512, write_through=seed % 2 == 1)
    radix = TieredRadixCache(PAGE, allocator.free, tier)
    radix.ahead_limit = 8
    stems = [[rng.randrange(100) for _ in range(4 * PAGE)] for _ in range(4)]
    prompts = []
    for _ in range(60):
        tokens = rng.choice(stems)[: rng.randrange(0, 5) * PAGE]
        tokens += [rng.randrange(100) for _ in range(rng.randint(1, 3) * PAGE)]
        prompts.append(tokens)
        if allocator.num_free < len(tokens) // PAGE:
            radix.evict(len(tokens) // PAGE - allocator.num_free)
        pages = allocator.alloc(len(tokens) // PAGE)
        allocator.free(pages[: radix.insert(tokens, pages) // PAGE])
        radix.queue_copies()
        tier.run_queued()
        for old in rng.sample(prompts, min(2, len(prompts))):  # touches, on either tier
            _, node = radix.match_prefix(old)
            radix.host_path(old, node, len(old))
    locked = radix.match_prefix(rng.choice(prompts))[1]
    radix.lock(locked)
    freed: list[list[int]] = []
    free = tier.allocator.free

    def recorded(pages: list[int]) -> None:
        freed.append(list(pages))
        free(pages)

    tier.allocator.free = recorded  # type: ignore[method-assign]
    for num_pages in (3, 10, 40, 1000):
        expected = [list(n.host) for n in walked_drops(radix, num_pages)]
        freed.clear()
        radix._drop_host(num_pages)
        assert freed == expected
        radix.check_integrity()
    radix.unlock(locked)
