"""A full host tier makes room ahead: one LRU drop frees a 64th of it, so the evictions
that follow find room without dropping again (a drop walks the whole tree on the
scheduler thread; one walk per evicted page cost 0.5 ms each with 1,024 host nodes)."""

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
