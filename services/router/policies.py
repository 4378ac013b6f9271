"""Routing policies: which of several candidate workers gets a request.

A policy sees the candidates (each with a `worker_id` and a `load`, the router's in-flight
count plus what the worker last reported) and the request's prompt token ids, and returns
one candidate. Policies never see gRPC, the pool or the HTTP request: tests drive them
with plain objects.

- `round_robin`: each candidate in turn.
- `random`: uniformly at random.
- `power_of_two`: the less loaded of two distinct random picks.
- `cache_aware`: the candidate whose cache holds the longest prefix of this prompt, unless
  the load is too uneven, then the least loaded. What a worker holds is known exactly from
  its KV events where they are fresh (`kv_index.py`), else guessed from the prompts sent
  to it (`prefix_tree.py`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, TypeVar

from baton.services.router.kv_index import CombinedIndex, KVIndex, PrefixIndex, valued
from baton.services.router.prefix_tree import PrefixTree

POLICY_NAMES = ("round_robin", "random", "power_of_two", "cache_aware")


class Candidate(Protocol):
    @property
    def worker_id(self) -> str: ...

    @property
    def load(self) -> float: ...


C = TypeVar("C", bound=Candidate)


class Policy(ABC):
    """Chooses one of a non-empty list of candidates for a prompt."""

    @abstractmethod
    def choose(self, candidates: Sequence[C], input_ids: Sequence[int]) -> C: ...

    def forget(self, worker_id: str) -> None:  # noqa: B027 - stateless policies keep nothing
        """`worker_id` left the cluster: drop whatever is remembered about it."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[C], input_ids: Sequence[int]) -> C:
        _require(candidates)
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class RandomChoice(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[C], input_ids: Sequence[int]) -> C:
        _require(candidates)
        return self._rng.choice(candidates)


class PowerOfTwo(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[C], input_ids: Sequence[int]) -> C:
        _require(candidates)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if a.load <= b.load else b


class CacheAware(Policy):
    """Longest remembered prefix wins; an uneven cluster falls back to the least loaded.

    The load is "uneven" when max - min > `balance_abs` and max > `balance_ratio` * min:
    both must hold, so a few requests of difference on a quiet cluster do not break
    stickiness, and a large cluster-wide load does not either. A prompt that matches
    nothing also goes to the least loaded. Either way the chosen worker is remembered
    for this prompt in the approximate tree, which holds at most `max_tokens` tokens
    (LRU-pruned). With `exact` (the router's KV index), prefixes are read from `index`:
    exact for workers whose events are fresh, the tree's guess for the others.
    """

    def __init__(
        self,
        balance_abs: float = 32,
        balance_ratio: float = 1.5,
        max_tokens: int = 1 << 20,
        rng: random.Random | None = None,
        exact: KVIndex | None = None,
    ) -> None:
        self._balance_abs = balance_abs
        self._balance_ratio = balance_ratio
        self._tree = PrefixTree(max_tokens)
        self._combined = None if exact is None else CombinedIndex(exact, self._tree)
        self._index: PrefixIndex = self._tree if self._combined is None else self._combined
        self._rng = rng or random.Random()

    @property
    def tree(self) -> PrefixTree:
        return self._tree

    @property
    def index(self) -> PrefixIndex:
        """What this policy believes each worker's cache holds of a prompt."""
        return self._index

    def choose(self, candidates: Sequence[C], input_ids: Sequence[int]) -> C:
        _require(candidates)
        chosen = None
        tiers = None if self._combined is None else self._combined.match_tiers(input_ids)
        matched = self._tree.match(input_ids) if tiers is None else valued(tiers)
        if not self._imbalanced(candidates):
            best = max((matched.get(c.worker_id, 0) for c in candidates), default=0)
            if best > 0:
                sticky = [c for c in candidates if matched.get(c.worker_id, 0) == best]
                chosen = _least_loaded(sticky, self._rng)
        if chosen is None:
            chosen = _least_loaded(candidates, self._rng)
        self._tree.insert(input_ids, chosen.worker_id)
        if self._combined is not None and tiers is not None:
            # every reused token, from either tier (workers report them so); a worker
            # computes at least the prompt's last token
            predicted = min(sum(tiers.get(chosen.worker_id, (0, 0))), len(input_ids) - 1)
            self._combined.exact.note_prediction(chosen.worker_id, predicted)
        return chosen

    def forget(self, worker_id: str) -> None:
        self._tree.remove_worker(worker_id)

    def _imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        high, low = max(loads), min(loads)
        return high - low > self._balance_abs and high > self._balance_ratio * low


def make_policy(
    name: str, rng: random.Random | None = None, exact: KVIndex | None = None
) -> Policy:
    """`exact`: the router's KV index, read by the policies that route on prefixes."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "cache_aware":
        return CacheAware(rng=rng, exact=exact)
    raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICY_NAMES)})")


def _least_loaded(candidates: Sequence[C], rng: random.Random) -> C:
    # Ties are broken at random so that an idle cluster spreads new prefixes.
    low = min(c.load for c in candidates)
    return rng.choice([c for c in candidates if c.load == low])


def _require(candidates: Sequence[object]) -> None:
    if not candidates:
        raise ValueError("no candidates to choose from")
