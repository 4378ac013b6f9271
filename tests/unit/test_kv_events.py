"""Exact KV events: a real radix cache with a small pool publishes what it stores and
evicts, the worker's publisher numbers and replays them, and the router's exact index
answers what the cache itself would match: through evictions, after a router restart
(a snapshot), and after a lost batch (a resync)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.radix import RadixCache
from baton.common.kv_events import KVEventBatch, PageEvent, PageSet, page_keys
from baton.common.protocol import KVEventsOut
from baton.common.rpc.convert import kv_batch_from_proto, kv_batch_to_proto
from baton.services.router.kv_index import SILENCE_S, CombinedIndex, KVIndex
from baton.services.router.metrics import RouterMetrics
from baton.services.router.policies import CacheAware
from baton.services.router.prefix_tree import PrefixTree
from baton.services.worker.kv_publisher import KVEventPublisher

pytestmark = pytest.mark.timeout(60)

PAGE = 4


class Worker:
    """A worker's cache as the scheduler drives it: a real radix tree over a small pool
    (prompts evict one another), its events shipped to a publisher once a step."""

    def __init__(self, num_pages: int = 24, seed: int = 0, incarnation: str = "inc-1") -> None:
        self.allocator = PageAllocator(num_pages)
        self.radix = RadixCache(PAGE, self.allocator.free)
        self.radix.publish_events()
        self.publisher = KVEventPublisher(incarnation, PAGE, backlog=8)
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(50) for _ in range(12)] for _ in range(3)]

    def prompt(self) -> list[int]:
        """A prompt sharing a prefix with others half the time."""
        head = self.rng.choice(self.prefixes) if self.rng.random() < 0.5 else []
        return head + [self.rng.randrange(50) for _ in range(self.rng.randrange(1, 14))]

    def cache(self, tokens: list[int]) -> None:
        """Store a prompt's full pages as `CacheManager` does: evict to make room, insert,
        free the duplicates of what the tree already held."""
        n = len(tokens) // PAGE
        if n > self.allocator.num_free:
            self.radix.evict(n - self.allocator.num_free)
        pages = self.allocator.alloc(n)
        held = self.radix.insert(tokens[: n * PAGE], pages)
        self.allocator.free(pages[: held // PAGE])

    def step(self) -> KVEventBatch | None:
        """The step's events, published (None: the cache did not change)."""
        events = self.radix.take_events()
        if not events:
            return None
        return self.publisher.publish(KVEventsOut(created_at=time.time(), events=events))

    def reuses(self, tokens: list[int]) -> int:
        """What the worker's `CacheManager` would reuse of a prompt."""
        pages, _ = self.radix.match_prefix(tokens[:-1])
        return len(pages) * PAGE


@dataclass
class Candidate:
    worker_id: str
    load: float = 0


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def router_index(metrics: RouterMetrics | None = None) -> KVIndex:
    return KVIndex(max_lag_s=1.0, metrics=metrics)


async def collect(stream: object, n: int) -> list[KVEventBatch]:
    out = []
    async for batch in stream:  # type: ignore[attr-defined]
        out.append(batch)
        if len(out) == n:
            break
    return out


def drain(worker: Worker, index: KVIndex) -> None:
    """Subscribe as the router does and apply what is there now (a snapshot or replay)."""

    async def run() -> list[KVEventBatch]:
        incarnation, seq = index.resume_from("w")
        stream = worker.publisher.subscribe(incarnation, seq)
        got = []
        async for batch in stream:
            got.append(batch)
            if batch.complete and batch.seq == worker.publisher.seq:
                break
        await stream.aclose()
        return got

    for batch in asyncio.run(run()):
        assert index.apply("w", kv_batch_from_proto(kv_batch_to_proto(batch)))


def assert_index_matches_cache(worker: Worker, index: KVIndex, probes: int = 60) -> None:
    cached = {key for node in worker.radix.all_nodes() for key in node.keys}
    assert index.sizes()["w"] == len(cached)
    for _ in range(probes):
        tokens = worker.prompt()
        assert index.match(tokens).get("w") == worker.reuses(tokens), tokens


def scripted(worker: Worker, steps: int) -> Iterator[KVEventBatch]:
    for _ in range(steps):
        for _ in range(worker.rng.randrange(1, 3)):
            worker.cache(worker.prompt())
        out = worker.step()
        if out is not None:
            yield out


# -- keys ---------------------------------------------------------------------------------


def test_page_keys_are_stable_and_chain_across_calls() -> None:
    # pinned: the router and every worker must compute the same keys, in any process
    assert page_keys([1, 2, 3, 4, 5], 2) == [2187946392326065592, 13621220241371379768]
    tokens = list(range(100, 140))
    whole = page_keys(tokens, 8)
    assert len(whole) == 5 and len(set(whole)) == 5
    assert page_keys(tokens[:16], 8) + page_keys(tokens[16:], 8, parent=whole[1]) == whole
    assert page_keys(tokens, 1)[:3] == [k for k in page_keys(tokens[:3], 1)]
    assert page_keys([1, 2, 3], 4) == []


def test_a_batch_crosses_the_wire_whole() -> None:
    batch = KVEventBatch(
        "inc", 7, 12.5, 16, [PageEvent(3, [4, 5]), PageEvent(removed=[2**64 - 1])], True, False, 9
    )
    assert kv_batch_from_proto(kv_batch_to_proto(batch)) == batch


# -- the cache publishes what it holds ----------------------------------------------------


def test_the_index_follows_inserts_and_evictions_exactly() -> None:
    worker, index = Worker(), router_index()
    index.track("w", "prefill")
    drain(worker, index)  # an empty snapshot: in sync from the start
    evicted = 0
    for batch in scripted(worker, 80):
        evicted += sum(len(e.removed) for e in batch.events)
        assert index.apply("w", batch)
        worker.radix.check_integrity()
        assert_index_matches_cache(worker, index, probes=5)
    assert evicted > 20, "the pool is small: prompts must have evicted one another"
    assert_index_matches_cache(worker, index)


def test_a_restarted_router_resyncs_from_a_snapshot() -> None:
    worker = Worker(seed=1)
    for _ in scripted(worker, 40):
        pass
    fresh = router_index()  # knows nothing: asks for seq 0
    fresh.track("w", "both")
    assert not fresh.fresh("w") and fresh.match([1, 2, 3, 4, 5]) == {}
    drain(worker, fresh)
    assert fresh.fresh("w")
    assert_index_matches_cache(worker, fresh)


def test_a_lost_batch_is_a_gap_and_the_index_resyncs() -> None:
    metrics = RouterMetrics(dict, "m")
    worker, index = Worker(seed=2), router_index(metrics)
    index.track("w", "prefill")
    drain(worker, index)
    batches = list(scripted(worker, 30))
    assert len(batches) > 3
    assert all(index.apply("w", b) for b in batches[:2])
    assert not index.apply("w", batches[3])  # batch 3 never arrived
    assert not index.fresh("w")
    assert metrics.kv_resyncs.labels("gap")._value.get() == 1
    # the backlog (8) no longer reaches back that far: the worker answers with a snapshot
    assert index.resume_from("w") == ("", 0)
    drain(worker, index)
    assert index.fresh("w")
    assert_index_matches_cache(worker, index)


def test_a_reconnect_within_the_backlog_replays_without_a_snapshot() -> None:
    worker, index = Worker(seed=3), router_index()
    index.track("w", "prefill")
    drain(worker, index)
    outs = list(scripted(worker, 4))
    assert 1 <= len(outs) <= 8
    incarnation, from_seq = index.resume_from("w")
    assert (incarnation, from_seq) == ("inc-1", 1)

    async def first() -> KVEventBatch:
        stream = worker.publisher.subscribe(incarnation, from_seq)
        batch = await anext(stream)
        await stream.aclose()
        return batch

    replayed = asyncio.run(first())
    assert replayed.seq == 1 and not replayed.reset


def test_a_new_incarnation_is_a_new_cache() -> None:
    worker, index = Worker(seed=4), router_index()
    index.track("w", "prefill")
    drain(worker, index)
    for batch in scripted(worker, 5):
        assert index.apply("w", batch)
    restarted = Worker(seed=4, incarnation="inc-2")
    batch = KVEventBatch("inc-2", 1, time.time(), PAGE, [])
    assert not index.apply("w", batch)  # not a snapshot: out of sync
    drain(restarted, index)
    assert index.sizes()["w"] == 0 and index.fresh("w")


def test_a_quiet_stream_stays_fresh_only_while_keepalives_come() -> None:
    clock = Clock()
    index = KVIndex(max_lag_s=1.0, clock=clock, wall_clock=clock)
    index.track("w", "both")
    index.apply("w", KVEventBatch("i", 0, clock.now, PAGE, [], reset=True))
    assert index.fresh("w")
    clock.now += SILENCE_S + 1
    assert not index.fresh("w")
    assert index.apply("w", KVEventBatch("i", 0, clock.now, PAGE, []))  # a keepalive
    assert index.fresh("w")
    assert index.apply("w", KVEventBatch("i", 1, clock.now - 3, PAGE, []))  # 3 s late
    assert not index.fresh("w")
    index.disconnected("w")
    assert not index.fresh("w")


def test_events_off_costs_nothing_and_changes_no_routing() -> None:
    allocator = PageAllocator(16)
    radix = RadixCache(PAGE, allocator.free)
    radix.insert(list(range(8)), allocator.alloc(2))
    radix.evict(2)
    assert radix.events is None and radix.take_events() == []
    assert all(not node.keys for node in radix.all_nodes())
    # routing with events off on the router, or on a router whose workers publish none,
    # chooses exactly as the approximate tree alone did
    rng = random.Random(7)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 9))] for _ in range(200)]
    loads = [[rng.randrange(3) for _ in range(3)] for _ in prompts]

    def choices(policy: CacheAware) -> list[str]:
        return [
            policy.choose([Candidate(f"w{i}", n) for i, n in enumerate(load)], p).worker_id
            for p, load in zip(prompts, loads, strict=True)
        ]

    plain = CacheAware(rng=random.Random(0))
    assert plain.index is plain.tree
    unused = KVIndex()
    unused.track("w0", "both")  # followed, never in sync: guessed like the rest
    assert choices(plain) == choices(CacheAware(rng=random.Random(0), exact=unused))


def test_routing_reads_exact_answers_where_fresh_and_guesses_elsewhere() -> None:
    worker, index = Worker(seed=5), router_index()
    index.track("w", "prefill")
    drain(worker, index)
    prompt = worker.prefixes[0] + [1, 2, 3]
    worker.cache(prompt)
    assert index.apply("w", worker.step())
    tree = PrefixTree()
    tree.insert(prompt, "w")  # the guess: everything
    tree.insert(prompt, "other")  # a worker without events: guessed
    combined = CombinedIndex(index, tree)
    assert combined.match(prompt) == {"w": 12, "other": len(prompt)}
    index.disconnected("w")
    assert combined.match(prompt) == {"w": len(prompt), "other": len(prompt)}


def test_cache_aware_routes_to_the_exact_holder_and_counts_its_prediction() -> None:
    metrics = RouterMetrics(dict, "m")
    worker, index = Worker(seed=6), router_index(metrics)
    index.track("w1", "prefill")
    index.track("w0", "prefill")
    for name in ("w0", "w1"):
        assert index.apply(name, KVEventBatch("inc-1", 0, time.time(), PAGE, [], reset=True))
    prompt = worker.prefixes[1] + [7, 7]
    worker.cache(prompt)
    assert index.apply("w1", worker.step())

    policy = CacheAware(rng=random.Random(0), exact=index)
    assert policy.choose([Candidate("w0"), Candidate("w1")], prompt).worker_id == "w1"
    assert metrics.kv_hit_tokens_predicted.labels("prefill")._value.get() == 12


def test_page_set_refuses_events_that_do_not_fit() -> None:
    pages = PageSet()
    pages.apply([PageEvent(0, [1, 2])])
    with pytest.raises(ValueError):
        pages.apply([PageEvent(99, [3])])
    with pytest.raises(ValueError):
        pages.apply([PageEvent(removed=[42])])
    snapshot = [e for part in PageSet().snapshot(4) for e in part]
    assert snapshot == []


def test_the_publisher_drops_a_subscriber_too_far_behind_and_ends_streams_on_stop() -> None:
    worker = Worker(seed=8)

    async def run() -> tuple[list[KVEventBatch], list[KVEventBatch]]:
        slow = worker.publisher.subscribe("", 0)
        snapshot = await anext(slow)  # subscribed; then it reads nothing for a while
        assert snapshot.reset and snapshot.complete
        published = list(scripted(worker, 40))
        assert len(published) > 8  # more than the backlog (8) behind: dropped
        behind = [b async for b in slow]
        # a stopping worker ends live streams, and refuses new ones at once
        live = worker.publisher.subscribe(worker.publisher.incarnation, worker.publisher.seq)
        first = await anext(live)
        worker.publisher.close()
        after_close = [b async for b in live]
        refused = [b async for b in worker.publisher.subscribe("", 0)]
        assert first.seq == worker.publisher.seq and not after_close and not refused
        return behind, published

    behind, published = asyncio.run(run())
    assert [b.seq for b in behind] == [b.seq for b in published[: len(behind)]]
    assert len(behind) <= 8


def test_a_worker_whose_clock_disagrees_is_still_judged_by_its_real_lag() -> None:
    clock = Clock()
    index = KVIndex(max_lag_s=1.0, clock=clock, wall_clock=clock)
    index.track("w", "both")
    behind = clock.now - 100.0  # the worker's clock runs 100 s behind the router's
    index.apply("w", KVEventBatch("i", 0, behind, PAGE, [], reset=True))
    assert index.apply("w", KVEventBatch("i", 1, behind - 0.1, PAGE, [PageEvent(0, [5])]))
    assert index.fresh("w")  # 0.1 s late, not 100
    assert index.apply("w", KVEventBatch("i", 2, behind - 2.0, PAGE, [PageEvent(5, [6])]))
    assert not index.fresh("w")  # 2 s late
