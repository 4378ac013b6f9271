"""KV events with a host tier (issue 43): pages evicted to the host and loaded back are
events, so the router's exact index knows which of a worker's pages are on the host,
through a router restart too, and routing counts them at `HOST_HIT_VALUE` (measured: 0.9)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from baton.common.cache.host_tier import HostTier
from baton.common.cache.tiered_radix import TieredRadixCache
from baton.common.kv_events import KVEventBatch, PageEvent, PageSet, page_keys
from baton.common.rpc.convert import kv_batch_from_proto, kv_batch_to_proto
from baton.services.router.kv_index import HOST_HIT_VALUE, KVIndex
from baton.services.router.metrics import RouterMetrics
from baton.services.router.policies import CacheAware
from tests.unit.test_kv_events import PAGE, Candidate, Worker, drain, router_index

pytestmark = pytest.mark.timeout(60)


class TieredWorker(Worker):
    """A worker whose small device pool evicts to a small host tier (which drops too)."""

    def __init__(self, seed: int = 0, host_pages: int = 16) -> None:
        super().__init__(num_pages=12, seed=seed)
        tier = HostTier(torch.zeros((12, PAGE)), host_pages, write_through=False)
        self.tier = tier
        self.radix = TieredRadixCache(PAGE, self.allocator.free, tier)
        self.radix.publish_events()

    def load(self, tokens: list[int]) -> None:
        """Load the host nodes continuing a prompt's device match, as `CacheManager._load`."""
        radix = self.radix
        assert isinstance(radix, TieredRadixCache)
        pages, node = radix.match_prefix(tokens)
        path = radix.host_path(tokens, node, len(pages) * PAGE)
        if not path:
            return
        radix.lock(path[-1])
        for host_node in path:
            need = len(host_node.host)
            if need > self.allocator.num_free:
                radix.evict(need - self.allocator.num_free)
            if need > self.allocator.num_free:
                break
            radix.promote(host_node, self.allocator.alloc(need), load=True)
        radix.unlock(path[-1])

    def tiers(self, tokens: list[int]) -> tuple[int, int]:
        """(device tokens, host tokens) the worker holds of a prompt's reusable prefix."""
        radix = self.radix
        assert isinstance(radix, TieredRadixCache)
        reusable = tokens[:-1]
        pages, node = radix.match_prefix(reusable)
        path = radix.host_path(reusable, node, len(pages) * PAGE)
        return len(pages) * PAGE, sum(len(n.host) for n in path) * PAGE

    def step(self) -> KVEventBatch | None:
        self.tier.run_queued()
        return super().step()


def assert_index_matches_tiers(worker: TieredWorker, index: KVIndex, probes: int = 30) -> None:
    nodes = worker.radix.all_nodes()
    assert index.sizes()["w"] == sum(len(n.keys) for n in nodes)
    assert index.host_sizes()["w"] == sum(len(n.keys) for n in nodes if not n.pages)
    for _ in range(probes):
        tokens = worker.prompt()
        assert index.match_tiers(tokens).get("w") == worker.tiers(tokens), tokens


def test_the_index_follows_moves_between_tiers_exactly() -> None:
    worker, index = TieredWorker(seed=1), router_index()
    index.track("w", "both")
    drain(worker, index)
    moves = {"to_host": 0, "to_device": 0, "removed": 0}
    for _ in range(120):
        for _ in range(worker.rng.randrange(1, 3)):
            prompt = worker.prompt()
            if worker.rng.random() < 0.5:
                worker.load(prompt)
            worker.cache(prompt)
        batch = worker.step()
        if batch is None:
            continue
        for event in batch.events:
            for kind in moves:
                moves[kind] += len(getattr(event, kind))
        assert index.apply("w", kv_batch_from_proto(kv_batch_to_proto(batch)))
        worker.radix.check_integrity()
        assert_index_matches_tiers(worker, index, probes=5)
    # stored, moved to the host, loaded back (or recomputed over), dropped from the host
    assert all(n > 10 for n in moves.values()), moves
    assert index.host_sizes()["w"] > 0
    assert_index_matches_tiers(worker, index)

    restarted = router_index()  # a router restart: its snapshot restores the tiers too
    restarted.track("w", "both")
    drain(worker, restarted)
    assert restarted.fresh("w") and restarted.host_sizes() == index.host_sizes()
    assert_index_matches_tiers(worker, restarted)


def test_a_batch_with_moves_crosses_the_wire_whole() -> None:
    events = [PageEvent(0, [4, 5]), PageEvent(to_host=[5]), PageEvent(to_device=[2**64 - 1])]
    batch = KVEventBatch("inc", 3, 1.5, PAGE, events)
    assert kv_batch_from_proto(kv_batch_to_proto(batch)) == batch


def test_a_move_of_a_page_not_held_is_inconsistent() -> None:
    pages = PageSet()
    pages.apply([PageEvent(0, [1, 2]), PageEvent(to_host=[2])])
    assert pages.matched_tiers([1, 2, 3]) == (1, 1) and pages.host_pages == 1
    with pytest.raises(ValueError):
        pages.apply([PageEvent(to_host=[7])])
    with pytest.raises(ValueError):
        pages.apply([PageEvent(to_device=[7])])
    pages.apply([PageEvent(removed=[2])])
    assert pages.host_pages == 0


def held(index: KVIndex, worker_id: str, tokens: list[int], host_from: int) -> None:
    """`worker_id` holds `tokens`' full pages, those from page `host_from` on the host."""
    keys = page_keys(tokens, PAGE)
    events = [PageEvent(0, keys), PageEvent(to_host=keys[host_from:])]
    assert index.apply(worker_id, KVEventBatch("inc", 1, time.time(), PAGE, events))


def route(
    prompt: list[int], a: int, a_device: int, b: int, metrics: RouterMetrics | None = None
) -> str:
    """Worker A holds `a` tokens of `prompt`, the first `a_device` of them on the device
    and the rest on the host; B holds `b` tokens, all on the device: which of the two
    cache_aware picks."""
    metrics = metrics or RouterMetrics(dict, "m")
    index = router_index(metrics)
    for name in ("A", "B"):
        index.track(name, "both")
        assert index.apply(name, KVEventBatch("inc", 0, time.time(), PAGE, [], reset=True))
    held(index, "A", prompt[:a], a_device // PAGE)
    held(index, "B", prompt[:b], b // PAGE)
    policy = CacheAware(rng=random.Random(0), exact=index)
    return policy.choose([Candidate("A"), Candidate("B")], prompt).worker_id


def test_a_device_hit_beats_the_same_prefix_on_the_host() -> None:
    prompt = list(range(100, 125))
    index = router_index()
    index.track("A", "both")
    index.apply("A", KVEventBatch("inc", 0, time.time(), PAGE, [], reset=True))
    held(index, "A", prompt[:16], 1)
    assert index.match_tiers(prompt)["A"] == (PAGE, 16 - PAGE)
    assert index.match(prompt)["A"] == PAGE + int(HOST_HIT_VALUE * (16 - PAGE))
    assert route(prompt, a=16, a_device=0, b=16) == "B"


def test_predicted_hit_tokens_count_host_tokens_in_full_as_workers_report_them() -> None:
    """Routing weighs a host token at its value, but the worker will report it found, so
    `kv_hit_tokens_predicted` counts it whole: predicted and found agree on a host hit."""
    metrics = RouterMetrics(dict, "m")
    prompt = list(range(100, 125))
    assert route(prompt, a=24, a_device=8, b=0, metrics=metrics) == "A"
    assert metrics.kv_hit_tokens_predicted.labels("both")._value.get() == 24


def test_a_longer_host_prefix_wins_only_past_its_discount() -> None:
    assert HOST_HIT_VALUE == 0.9  # measured: a host token is worth 0.9 of a device token
    prompt = list(range(100, 125))
    # A: 24 tokens on the host (worth 21) against B's 20 on the device: A
    assert route(prompt, a=24, a_device=0, b=20) == "A"
    # A: 20 tokens on the host (worth 18) against B's 16 on the device: A
    assert route(prompt, a=20, a_device=0, b=16) == "A"
    # A: 16 tokens on the host (worth 14) against B's 16 on the device: B
    assert route(prompt, a=16, a_device=0, b=16) == "B"
    # A: 4 on the device then 20 on the host (worth 4 + 18) against B's 20: A
    assert route(prompt, a=24, a_device=4, b=20) == "A"
    # A: 4 on the device then 12 on the host (worth 4 + 10) against B's 16: B
    assert route(prompt, a=16, a_device=4, b=16) == "B"
