"""Unit tests of the engine's collaborators, each alone: page allocator, cache manager,
admission, prefill manager (fcfs / lpm, chunk budget), decode manager (reservation,
retraction, waiting), and the CUDA-graph page-buffer sizing rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.common.cache.allocator import OutOfPages, PageAllocator
from baton.common.cache.manager import CacheManager
from baton.common.cache.radix import RadixCache
from baton.common.cache.req_to_token import ReqToTokenTable
from baton.common.devices import flat_array, to_device
from baton.common.engine.admission import Admission
from baton.common.engine.cuda_graph import (
    _adjacent,
    capture_sizes,
    graph_page_capacity,
    resolve_future,
)
from baton.common.engine.decode import DecodeManager, NeedSync
from baton.common.engine.prefill import PrefillManager
from baton.common.sampling import SamplingParams
from baton.common.state import Req, ScheduledBatch


def req(rid: str, tokens: list[int], max_new: int = 8) -> Req:
    return Req(rid, tokens, SamplingParams(max_new_tokens=max_new), 0, frozenset())


def parts(pages: int, page_size: int = 4, radix: bool = True, rows: int = 8, reserve: int = 4):
    allocator = PageAllocator(pages)
    table = ReqToTokenTable(rows, 256, "cpu")
    cache = CacheManager(
        page_size, allocator, table, RadixCache(page_size, allocator.free) if radix else None
    )
    decode = DecodeManager(cache, reserve)
    return cache, decode, Admission(cache, decode, max_running=rows - 1)


# -- request-to-token table -------------------------------------------------------------
def test_table_writes_land_in_their_rows_and_columns_only() -> None:
    table = ReqToTokenTable(4, 16, "cpu")
    table.write_many([(2, 3, [7, 8, 9]), (0, 0, [1]), (3, 14, [5, 6]), (1, 5, [])])
    want = torch.zeros(4, 16, dtype=torch.int64)
    want[2, 3:6] = torch.tensor([7, 8, 9])
    want[0, 0] = 1
    want[3, 14:16] = torch.tensor([5, 6])
    assert torch.equal(table.table, want)
    table.write_many([])
    assert torch.equal(table.table, want)


# -- decode graph inputs ----------------------------------------------------------------
def test_a_decode_steps_metadata_reaches_a_graph_as_one_view_where_it_was_uploaded_so() -> None:
    """Positions, KV slots, table rows, lengths and future-map entries, as `prepare`
    uploads them: one [5, B] view, one copy into the graph's buffer."""
    lists = [[7, 9, 4], [70, 90, 40], [1, 2, 3], [8, 10, 5], [12, 13, 14]]
    uploaded = to_device([*lists, [0, 0, 0]], torch.device("cpu"))
    meta = _adjacent(uploaded[:5], 3)
    assert meta is not None and meta.tolist() == lists
    assert _adjacent(uploaded[:4], 3) is not None  # a TP follower's step: no future entries
    assert _adjacent([uploaded[0], uploaded[2]], 3) is None  # not one after another
    apart = [torch.tensor(values) for values in lists]
    assert _adjacent(apart, 3) is None  # separate tensors: the runner copies each


def test_a_steps_columns_upload_in_order_whatever_their_parts() -> None:
    """A prompt's slots come as numpy arrays and its positions as ranges, a decode step's as
    lists of one; a table write may hold either. Every value lands in order, in place."""
    prompt_slots = np.arange(160, 160 + 100)
    parts = [[5], range(0, 100), range(3, 4), [1, 2], prompt_slots, list(range(70)), []]
    want = [5, *range(100), 3, 1, 2, *prompt_slots.tolist(), *range(70)]
    assert flat_array(parts, torch.int64).tolist() == want
    assert flat_array([], torch.int64).tolist() == []
    columns = to_device([flat_array(parts, torch.int64), [9], prompt_slots], torch.device("cpu"))
    assert [c.tolist() for c in columns] == [want, [9], prompt_slots.tolist()]
    table = ReqToTokenTable(2, 128, "cpu")
    table.write_many([(1, 0, prompt_slots), (0, 4, [7])])
    assert table.table[1, :100].tolist() == prompt_slots.tolist() and table.table[0, 4] == 7


def test_future_references_read_the_future_map() -> None:
    future = torch.tensor([0, 11, 22, 33])
    ids = torch.tensor([5, -2, 0, -3])
    assert resolve_future(ids, future).tolist() == [5, 22, 0, 33]


# -- page allocator -------------------------------------------------------------------
def test_allocator_hands_out_lowest_ids_and_refuses_double_free() -> None:
    a = PageAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    a.free([1])
    assert a.alloc(2) == [1, 3]  # lowest first keeps a request's pages contiguous
    with pytest.raises(OutOfPages):
        a.alloc(5)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([5])
    a.check_integrity()


# -- cache manager ----------------------------------------------------------------------
def test_cache_manager_shares_a_prefix_and_frees_exactly_once() -> None:
    cache, _, _ = parts(16)
    a, b = req("a", list(range(10))), req("b", [*range(8), 50, 51])
    cache.admit(a)
    cache.extend(a, 10)
    cache.cache_prefix(a)  # two full pages into the tree
    assert a.cached_len == 8
    cache.admit(b)
    assert b.cached_len == 8 and b.pages[:2] == a.pages[:2]  # shared through the tree
    cache.extend(b, 2)
    cache.check_integrity([a, b])
    for r in (a, b):
        cache.release(r)
        cache.release(r)  # idempotent
    cache.check_integrity([])
    assert cache.allocator.num_free + cache.radix.total_pages == 16  # type: ignore[union-attr]


def test_take_and_release_held_memory() -> None:
    cache, _, _ = parts(8, radix=False)
    a = req("a", list(range(6)))
    cache.admit(a)
    cache.extend(a, 6)
    held = cache.take(a)
    assert a.slot is None and not a.pages and a.device_len == 0
    assert cache.allocator.num_free == 6  # still held
    cache.release_held(held)
    assert cache.allocator.num_free == 8
    cache.check_integrity([])


# -- admission --------------------------------------------------------------------------
def test_admission_counts_the_decode_reserve_of_reserved_requests() -> None:
    cache, decode, admission = parts(9, page_size=4, reserve=8)
    first = req("first", list(range(12)), max_new=8)  # 3 pages + 2 reserve
    assert admission.try_admit(first, with_decode_reserve=True)
    cache.extend(first, 12)
    decode.reserve(first)
    # 6 pages left, 2 of them reserved for `first`: a 3+2-page room no longer fits
    second = req("second", list(range(100, 112)), max_new=8)
    assert not admission.try_admit(second, with_decode_reserve=True)
    assert second.slot is None  # left untouched
    small = req("small", [1, 2, 3], max_new=1)
    assert admission.try_admit(small, with_decode_reserve=True)


def test_admission_respects_the_running_cap() -> None:
    _cache, decode, admission = parts(64, rows=3)  # max_running = 2
    for i in range(2):
        r = req(f"r{i}", [i, i + 1])
        assert admission.try_admit(r)
        decode.reserve(r)
    assert not admission.try_admit(req("late", [9]))


# -- prefill manager ----------------------------------------------------------------------
def test_prefill_chunks_within_the_budget_and_continues_first() -> None:
    cache, _, admission = parts(64)
    pm = PrefillManager(cache, admission, "fcfs", token_budget=8, chunked=True)
    long, short = req("long", list(range(20))), req("short", [1, 2, 3])
    pm.add(long)
    pm.add(short)
    plans = []
    for _ in range(3):
        plan = ScheduledBatch()
        pm.schedule(plan)
        plans.append([(it.req.rid, it.prefix_len, it.extend_len, it.sample) for it in plan.items])
    assert plans == [
        [("long", 0, 8, False)],
        [("long", 8, 8, False)],
        [("long", 16, 4, True), ("short", 0, 3, True)],
    ]


def test_lpm_puts_the_longest_cached_prefix_first() -> None:
    cache, _, admission = parts(64)
    warm = req("warm", list(range(16)))
    cache.admit(warm)
    cache.extend(warm, 16)
    cache.release(warm, cache=True)
    pm = PrefillManager(cache, admission, "lpm", token_budget=1000, chunked=False)
    cold, hit = req("cold", [99] * 16), req("hit", [*range(16), 7])
    pm.add(cold)
    pm.add(hit)
    plan = ScheduledBatch()
    pm.schedule(plan)
    assert [it.req.rid for it in plan.items] == ["hit", "cold"]
    assert plan.items[0].prefix_len == 16  # computed only its new token


def test_a_suspect_is_scheduled_alone() -> None:
    cache, _, admission = parts(64)
    pm = PrefillManager(cache, admission, "fcfs", token_budget=1000, chunked=False)
    a, b = req("a", [1, 2]), req("b", [3, 4])
    b.suspect = True
    pm.add(a)
    pm.add(b)
    plan = ScheduledBatch()
    pm.schedule(plan)
    assert [it.req.rid for it in plan.items] == ["b"] and plan.solo


# -- decode manager -----------------------------------------------------------------------
def running(cache: CacheManager, decode: DecodeManager, rid: str, n: int, max_new: int = 64) -> Req:
    r = req(rid, list(range(n)), max_new=max_new)
    cache.admit(r)
    cache.extend(r, n)
    r.output_ids.append(1)
    decode.add(r)
    return r


def test_decode_retracts_the_newest_when_the_pool_is_short() -> None:
    cache, decode, _ = parts(6, page_size=4, radix=False)
    old = running(cache, decode, "old", 12)  # 3 pages, the 4th token slot is free
    new = running(cache, decode, "new", 12)  # 3 pages: pool full
    plan = ScheduledBatch()
    with pytest.raises(NeedSync):  # with a step in flight, retraction waits for it
        decode.schedule(plan, has_unprocessed=True)
    retracted = decode.schedule(plan, has_unprocessed=False)
    assert retracted == [new] and new.slot is None
    assert [it.req for it in plan.items] == [old]
    assert decode.num_retracted == 1


def test_decode_waits_instead_of_failing_when_reserved_rooms_hold_the_pages() -> None:
    cache, decode, _ = parts(4, page_size=4, radix=False)
    only = running(cache, decode, "only", 8)  # 2 pages, needs a 3rd for its next token
    incoming = req("incoming", list(range(8)))
    cache.admit(incoming)
    cache.extend(incoming, 8)  # the last 2 pages, reserved for a room in flight
    decode.reserve(incoming)
    plan = ScheduledBatch()
    assert decode.schedule(plan, has_unprocessed=False) == []
    assert plan.items == []  # it waits a step; nothing fails
    assert only.slot is not None


# -- CUDA-graph sizing ----------------------------------------------------------------------
@pytest.mark.parametrize("max_bs", [1, 3, 64, 208, 256, 300])
def test_every_batch_up_to_the_largest_replays_a_graph(max_bs: int) -> None:
    # 4x H200, 3P1D with --max-running-requests 208: sizes stopped at 192, so the decode
    # worker's batches of 193-208 ran eager, TPOT p50 23.6 ms against 17.4 ms at 256
    sizes = capture_sizes(max_bs)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == max_bs
    assert all(any(s >= bs for s in sizes) for bs in range(1, max_bs + 1))


@pytest.mark.parametrize(("max_bs", "ctx", "page"), [(128, 131072, 1), (64, 8192, 16), (3, 100, 7)])
def test_graph_page_buffer_holds_the_worst_batch(max_bs: int, ctx: int, page: int) -> None:
    cap = graph_page_capacity(max_bs, ctx, page)
    bs = capture_sizes(max_bs)[-1]
    # every row at the longest sequence a decode step can see (context + 1 KV slots)
    assert cap >= bs * -(-(ctx + 1) // page)
    # rows sharing one prefix-cache prefix still fit: the pool's size is not the bound
    assert cap >= bs * -(-ctx // page)
