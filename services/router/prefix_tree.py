"""An approximate radix tree of the prompts routed to each worker.

Each edge holds a run of token ids; each node remembers which workers were sent a prompt
passing through it. `match(tokens)` answers, per worker, how many leading tokens of
`tokens` that worker has seen: a guess at what its radix cache still holds. The guess is
approximate on purpose: workers evict on their own and nothing tells the router.

Invariant: a node's workers include the workers of all its descendants (insert marks the
whole path), so removing a worker empties whole subtrees, and LRU pruning can drop leaves
without consulting anyone. Memory is bounded by `max_tokens` tokens on edges; when an
insert passes it, least recently used leaves go until 90% of the bound is left. An edge
keeps its tokens in an `array('i')`, 4 bytes a token: as tuples of ints they took about 41,
and a router at 4 req/s grew its RSS by 2 MB a minute until the bound, 40 MiB later.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence

_PRUNE_TO = 0.9


class _Node:
    __slots__ = ("children", "key", "last_used", "parent", "workers")

    def __init__(self, key: array[int], parent: _Node | None) -> None:
        self.key = key  # the edge's tokens, from parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.workers: set[str] = set()
        self.last_used = 0


class PrefixTree:
    def __init__(self, max_tokens: int = 1 << 20) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._max_tokens = max_tokens
        self._root = _Node(array("i"), None)
        self._size = 0
        self._clock = itertools.count(1)

    @property
    def size(self) -> int:
        """Tokens stored on the tree's edges."""
        return self._size

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """worker_id -> length of the longest prefix of `tokens` routed to that worker."""
        matched: dict[str, int] = {}
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_prefix_len(child.key, tokens, pos)
            pos += common
            for worker_id in child.workers:
                matched[worker_id] = pos
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, tokens: Sequence[int], worker_id: str) -> None:
        """Remember that `tokens` went to `worker_id`."""
        tick = next(self._clock)
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = _Node(array("i", tokens[pos:]), node)
                node.children[tokens[pos]] = child
                self._size += len(child.key)
                common = len(child.key)
            else:
                common = _common_prefix_len(child.key, tokens, pos)
                if common < len(child.key):
                    child = self._split(child, common)
            child.workers.add(worker_id)
            child.last_used = tick
            pos += common
            node = child
        if self._size > self._max_tokens:
            self._prune(int(self._max_tokens * _PRUNE_TO))

    def remove_worker(self, worker_id: str) -> None:
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                child.workers.discard(worker_id)
                if child.workers:
                    stack.append(child)
                else:
                    self._drop_subtree(child)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; return the new upper node."""
        assert node.parent is not None and 0 < at < len(node.key)
        upper = _Node(node.key[:at], node.parent)
        upper.workers = set(node.workers)
        upper.last_used = node.last_used
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _drop_subtree(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            self._size -= len(n.key)
            stack.extend(n.children.values())

    def _prune(self, target: int) -> None:
        order = itertools.count()  # tie-break: nodes themselves are not comparable
        heap = [(n.last_used, next(order), n) for n in self._leaves()]
        heapq.heapify(heap)
        while heap and self._size > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._drop_subtree(leaf)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, next(order), parent))

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves


def _common_prefix_len(key: array[int], tokens: Sequence[int], start: int) -> int:
    limit = min(len(key), len(tokens) - start)
    i = 0
    while i < limit and key[i] == tokens[start + i]:
        i += 1
    return i
