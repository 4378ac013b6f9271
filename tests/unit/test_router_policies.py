"""Routing policies and the prefix tree behind cache-aware routing (pure, no gRPC)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from baton.services.router.policies import (
    CacheAware,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
    make_policy,
)
from baton.services.router.prefix_tree import PrefixTree


@dataclass
class Worker:
    worker_id: str
    load: float = 0


def workers(*loads: float) -> list[Worker]:
    return [Worker(f"w{i}", load) for i, load in enumerate(loads)]


# -- simple policies ----------------------------------------------------------------------


def test_round_robin_visits_every_worker_in_turn() -> None:
    policy, pool = RoundRobin(), workers(0, 0, 0)
    chosen = [policy.choose(pool, [1, 2]).worker_id for _ in range(6)]
    assert chosen == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_random_uses_every_worker() -> None:
    policy, pool = RandomChoice(random.Random(0)), workers(0, 0, 0)
    counts = Counter(policy.choose(pool, []).worker_id for _ in range(300))
    assert set(counts) == {"w0", "w1", "w2"} and min(counts.values()) > 60


def test_power_of_two_never_picks_the_busiest_of_three() -> None:
    policy, pool = PowerOfTwo(random.Random(0)), workers(5, 50, 1)
    counts = Counter(policy.choose(pool, []).worker_id for _ in range(300))
    assert "w1" not in counts  # any pair containing w1 has a less loaded other member
    assert counts["w2"] > counts["w0"]


def test_power_of_two_with_one_worker() -> None:
    assert PowerOfTwo().choose(workers(9), []).worker_id == "w0"


@pytest.mark.parametrize("name", ["round_robin", "random", "power_of_two", "cache_aware"])
def test_every_policy_refuses_an_empty_list_and_is_made_by_name(name: str) -> None:
    policy = make_policy(name)
    with pytest.raises(ValueError):
        policy.choose([], [1])
    assert policy.choose(workers(0), [1]).worker_id == "w0"


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")


# -- cache aware ----------------------------------------------------------------------------


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker() -> None:
    policy, pool = CacheAware(rng=random.Random(1)), workers(0, 0, 0)
    system = list(range(100, 164))
    first = policy.choose(pool, [*system, 1, 2, 3]).worker_id
    for tail in ([4, 5], [6], [7, 8, 9]):
        assert policy.choose(pool, system + tail).worker_id == first


def test_cache_aware_spreads_unrelated_prompts_by_load() -> None:
    policy, pool = CacheAware(rng=random.Random(1)), workers(3, 0, 3)
    assert policy.choose(pool, [1, 2, 3]).worker_id == "w1"  # no match: least loaded


def test_cache_aware_prefers_the_longest_match() -> None:
    policy, pool = CacheAware(), workers(0, 0)
    policy.tree.insert([1, 2, 3, 4, 5, 6], "w0")
    policy.tree.insert([1, 2, 3, 9], "w1")
    assert policy.choose(pool, [1, 2, 3, 4, 5, 7]).worker_id == "w0"
    assert policy.choose(pool, [1, 2, 3, 9, 9]).worker_id == "w1"


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ((20, 2), "w0"),  # uneven by a little: stickiness wins
        ((80, 10), "w1"),  # abs > 32 and ratio > 1.5: the least loaded wins
        ((140, 100), "w0"),  # a large but proportionate difference is not imbalance
    ],
)
def test_cache_aware_falls_back_to_least_loaded_when_imbalanced(
    loads: tuple[float, float], expected: str
) -> None:
    policy = CacheAware(balance_abs=32, balance_ratio=1.5)
    policy.tree.insert([1, 2, 3, 4], "w0")
    assert policy.choose(workers(*loads), [1, 2, 3, 4]).worker_id == expected


def test_cache_aware_forgets_a_worker_that_left() -> None:
    policy = CacheAware()
    policy.tree.insert([1, 2, 3], "w0")
    policy.forget("w0")
    assert policy.tree.match([1, 2, 3]) == {}
    assert policy.tree.size == 0


# -- the prefix tree ---------------------------------------------------------------------


def test_tree_match_lengths_per_worker() -> None:
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 5], "b")
    tree.insert([1, 2, 3, 4, 5, 6], "c")
    assert tree.match([1, 2, 3, 4, 5, 6, 7]) == {"a": 4, "b": 2, "c": 6}
    assert tree.match([1, 2, 5, 0]) == {"a": 2, "b": 3, "c": 2}
    assert tree.match([9]) == {}
    assert tree.match([]) == {}
    assert tree.size == 7  # [1,2] + [3,4] + [5,6] + [5]: edges share the common prefix


def test_tree_prunes_least_recently_used_prompts_to_stay_bounded() -> None:
    tree = PrefixTree(max_tokens=100)
    for i in range(50):
        tree.insert([i, *range(1000, 1009)], f"w{i % 3}")  # 10 tokens each, distinct heads
        assert tree.size <= 100
    # The newest prompts survive, the oldest are gone.
    assert tree.match([49, *range(1000, 1009)]) == {"w1": 10}
    assert tree.match([0, *range(1000, 1009)]) == {}


def test_tree_touching_a_prompt_keeps_it_alive() -> None:
    tree = PrefixTree(max_tokens=30)
    tree.insert([0] * 10, "w0")
    for i in range(1, 10):
        tree.insert([0] * 10, "w0")  # reused: most recently used, never pruned
        tree.insert([i] * 10, "w1")
    assert tree.match([0] * 10) == {"w0": 10}


def test_tree_remove_worker_keeps_shared_paths_of_others() -> None:
    tree = PrefixTree()
    tree.insert([1, 2, 3], "a")
    tree.insert([1, 2, 4], "b")
    tree.remove_worker("a")
    assert tree.match([1, 2, 3]) == {"b": 2}
    assert tree.size == 3


def test_the_prefix_tree_holds_a_routed_token_in_a_few_bytes() -> None:
    """A router's memory grows with the prompts it routes until the tree's bound: 4 bytes a
    token on the edges, not the ~41 of tuples of ints (2 MB a minute at 4 req/s)."""
    import tracemalloc

    tree = PrefixTree(max_tokens=1 << 22)
    prompts = [[i, *range(1000 + i, 1000 + i + 4000)] for i in range(50)]  # 200k tokens
    tracemalloc.start()
    for i, p in enumerate(prompts):
        tree.insert(p, f"w{i % 4}")
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert tree.size == sum(len(p) for p in prompts)
    assert used / tree.size < 8
    assert tree.match(prompts[7]) == {"w3": len(prompts[7])}
