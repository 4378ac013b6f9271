"""The host tier's pool keeps its size and its room: pinned by registering its own memory
(torch's pinned allocator rounds a block up to a power of two) and unregistered when it
goes; when full, one LRU drop frees a 64th of it, so the evictions that follow find room
without dropping again (a drop walks the whole tree on the scheduler thread; one walk per
evicted page cost 0.5 ms each with 1,024 host nodes)."""

from __future__ import annotations

import torch

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.host_tier import HostTier
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

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        return self.answer

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


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
