"""Copies ahead of eviction (issue 43: GPU->host offload never adds more than 5% to a
decode step): once launches evict pages, the next pages in eviction order get host
copies at launch, which the step does not wait for; evicting them later copies nothing
and fences the next step instead."""

from __future__ import annotations

import torch

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.host_tier import HostTier
from baton.common.cache.tiered_radix import AHEAD_STEPS, TieredRadixCache

PAGE = 2


def make_tree(device_pages: int = 64) -> tuple[TieredRadixCache, PageAllocator, torch.Tensor]:
    allocator = PageAllocator(device_pages)
    pool = torch.zeros((device_pages, PAGE), dtype=torch.int64)
    tier = HostTier(pool, 64, write_through=False)
    return TieredRadixCache(PAGE, allocator.free, tier), allocator, pool


def cache_prefix(radix: TieredRadixCache, allocator: PageAllocator, first: int, pages: int):  # type: ignore[no-untyped-def]
    tokens = list(range(first, first + pages * PAGE))
    radix.insert(tokens, allocator.alloc(pages))
    _, node = radix.match_prefix(tokens)
    return node


def launch(radix: TieredRadixCache):  # type: ignore[no-untyped-def]
    radix.queue_copies()
    moves = radix.tier.take_moves(radix.launches)
    if moves is not None:
        moves.run()
    return moves


def test_evictions_make_the_next_launches_copy_ahead_and_those_pages_then_evict_free() -> None:
    radix, allocator, _ = make_tree()
    nodes = [cache_prefix(radix, allocator, 1000 * i, 2) for i in range(6)]
    launch(radix), launch(radix)  # (computed by now)
    assert radix.tier.counters.bytes_to_host == 0, "no eviction yet: nothing copied ahead"

    oldest = nodes[0].pages
    radix.evict(2)  # the oldest node, copied on demand: its step waits for it
    moves = launch(radix)
    assert moves is not None and [m.device_pages for m in moves.moves[: moves.wait]] == [oldest]
    ahead = moves.moves[moves.wait :]  # the next nodes, not waited for
    assert sum(len(m.device_pages) for m in ahead) == AHEAD_STEPS * 2
    assert all(m.to_host for m in ahead)
    assert [bool(n.host) for n in nodes] == [True, True, True, False, False, False]
    assert nodes[1].copied_at == nodes[2].copied_at == radix.launches

    copied = radix.tier.counters.bytes_to_host
    radix.evict(2)  # the next node: its copy ran already
    assert radix.tier.counters.bytes_to_host == copied
    assert not nodes[1].pages and nodes[1].host, "kept on the host tier"
    assert radix.tier.queued, "the next step must wait for that copy before it writes the pages"
    moves = launch(radix)
    assert moves is not None and moves.wait == 0  # only copies ahead, and the fence (CUDA)
    radix.check_integrity()


def test_a_page_copied_ahead_still_serves_hits_and_holds_its_tokens_on_both_tiers() -> None:
    radix, allocator, pool = make_tree()
    nodes = [cache_prefix(radix, allocator, 1000 * i, 2) for i in range(4)]
    for node in nodes:
        pool[node.pages] = torch.tensor(node.key).view(-1, PAGE)
    launch(radix), launch(radix)
    radix.evict(2)
    launch(radix)
    assert nodes[1].pages and nodes[1].host
    pages, hit = radix.match_prefix(nodes[1].key)
    assert hit is nodes[1] and pages == nodes[1].pages
    assert radix.tier.buffer[nodes[1].host].flatten().tolist() == nodes[1].key
    radix.evict(radix.evictable_pages)
    radix.tier.run_queued()
    radix.check_integrity()
    for node in nodes:
        assert not node.pages and radix.tier.buffer[node.host].flatten().tolist() == node.key
    radix.reset()
    assert allocator.num_free == 64 and radix.tier.pages_used == 0


def test_pages_that_just_came_in_are_not_copied_ahead_before_they_are_computed() -> None:
    radix, allocator, _ = make_tree()
    cache_prefix(radix, allocator, 0, 2)
    old = cache_prefix(radix, allocator, 1000, 2)
    launch(radix), launch(radix)
    radix.evict(2)  # demand: the next launches copy ahead
    young = cache_prefix(radix, allocator, 5000, 2)  # the step being scheduled computes it
    launch(radix)
    assert old.host and not young.host
    launch(radix)
    assert young.host and young.copied_at == radix.launches


def test_copies_ahead_stop_once_no_launch_evicts_and_stay_within_an_eighth_of_the_pool() -> None:
    radix, allocator, _ = make_tree(device_pages=64)
    nodes = [cache_prefix(radix, allocator, 1000 * i, 1) for i in range(40)]
    launch(radix), launch(radix)
    radix.evict(30)  # a burst: twice over would be 60 pages, the pool's eighth is 8
    launch(radix)
    copied_ahead = [n for n in nodes if n.pages and n.host]
    assert len(copied_ahead) == 64 // 8
    for _ in range(8):  # the burst leaves the window
        launch(radix)
    copied = radix.tier.counters.bytes_to_host
    for node in copied_ahead:  # used again: the next to evict have no copy now
        radix.match_prefix(node.key)
    launch(radix)
    assert radix.tier.counters.bytes_to_host == copied, "no eviction lately: nothing copied"
