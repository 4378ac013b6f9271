"""Radix tree over page-aligned token keys; nodes own KV pages.

Only whole pages enter the tree: a key is a token sequence whose length is a multiple of
`page_size`, and a node holding k tokens owns k / page_size pages. Children are keyed by
their first page of tokens. A node with `lock_ref > 0` (some running request reads it,
or an ancestor of such a node) is never evicted; unlocked leaves are evicted LRU.

Ownership: `insert` takes ownership of the pages it stores. Pages of a key prefix that the
tree already holds are *not* taken: the caller still owns those duplicates and frees them.

KV events (`publish_events`): each node then also keeps its pages' chained keys
(`kv_events.page_keys`), hashed once as the node enters the tree, and every page stored or
evicted appends a `PageEvent` to `events`, which the worker takes after each step.

Eviction order: a heap of unlocked device leaves by last access, kept across calls
(`_lru`), so that finding the next leaves to evict costs what is taken, not a walk of the
tree. Entries go stale rather than out: a node touched, locked, given a device child or
evicted keeps its old entry, which is skipped when met. A node gets a new one whenever it
may have become an unlocked leaf (touched at the end of a match or insert, unlocked, come
in, or a parent whose device children were all taken); the heap is rebuilt from a walk
once it holds four times as many entries as after the last rebuild (at least `REBUILD`).

A node whose `pages` are empty is a host node, its KV in `host` pages: only a
`TieredRadixCache` (`tiered_radix.py`) has them; the hooks it overrides are marked.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from baton.common.kv_events import ROOT, PageEvent, page_keys

if TYPE_CHECKING:
    from baton.common.cache.host_tier import HostTier

_clock = itertools.count()
_order = itertools.count()  # ties in the eviction heap: first pushed, first out
REBUILD = 1024  # the eviction heap is never rebuilt below this size


def lru_entry(node: RadixNode) -> tuple[int, int, RadixNode]:
    """`node`'s entry in a heap by last access (ties: first pushed, first out)."""
    return node.last_access, next(_order), node


def touch(node: RadixNode) -> None:
    """Mark `node` used now (eviction is least recently used first)."""
    node.last_access = next(_clock)


class RadixNode:
    __slots__ = (
        "born",
        "children",
        "copied_at",
        "host",
        "key",
        "keys",
        "last_access",
        "lock_ref",
        "pages",
        "parent",
    )

    def __init__(self, key: list[int], pages: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.keys: list[int] = []  # the pages' chained keys, while events are published
        self.host: list[int] = []  # host-tier pages: the KV itself where `pages` is empty
        self.born = 0  # the launch (`TieredRadixCache.launches`) during which `pages` came in
        self.copied_at = 0  # the launch whose copies read `pages` into `host` (0: none)

    def __lt__(self, other: RadixNode) -> bool:
        return self.last_access < other.last_access


class RadixCache:
    tier: HostTier | None = None  # the host tier, in a `TieredRadixCache`

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self.root = RadixNode([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_pages = 0
        self.protected_pages = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.events: list[PageEvent] | None = None  # None: no events are published
        # (last access, tie, node) of every unlocked device leaf, and stale entries
        self._lru: list[tuple[int, int, RadixNode]] = []
        self._lru_built = 0  # its size at the last rebuild

    def publish_events(self) -> None:
        """From now on, log every page stored and evicted in `events`. Pages already in the
        tree get their keys now (no event: a subscriber starts from a snapshot)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                child.keys = page_keys(child.key, self.page_size, self._last_key(node))
                stack.append(child)
        self.events = []

    def take_events(self) -> list[PageEvent]:
        """The events logged since the last call (none while events are not published)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _last_key(self, node: RadixNode) -> int:
        return node.keys[-1] if node is not self.root else ROOT

    # -- lookups -----------------------------------------------------------------------
    def match_prefix(
        self, tokens: Sequence[int], record: bool = False
    ) -> tuple[list[int], RadixNode]:
        """Longest page-aligned prefix of `tokens` in the tree: (its pages, its last node)."""
        p = self.page_size
        node, pages, i = self.root, [], 0
        node.last_access = next(_clock)
        n = len(tokens) - len(tokens) % p
        while i < n:
            child = node.children.get(tuple(tokens[i : i + p]))
            if child is None or not child.pages:  # (a host node: see `host_path`)
                break
            m = self._common_len(child.key, tokens, i)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = next(_clock)
            pages.extend(child.pages)
            node, i = child, i + len(child.key)
        self._offer(node)  # (the nodes before it have a device child: the next one)
        if record:
            self.query_tokens += len(tokens)
            self.hit_tokens += i
        return pages, node

    def _common_len(self, key: list[int], tokens: Sequence[int], start: int) -> int:
        """Tokens, in whole pages, that `key` and `tokens[start:]` share at their start."""
        p = self.page_size
        limit = min(len(key), len(tokens) - start)
        limit -= limit % p
        if key[:limit] == list(tokens[start : start + limit]):  # most often all of them:
            return limit  # one comparison in C, not one per page
        m = 0
        while m + p <= limit and key[m : m + p] == list(tokens[start + m : start + m + p]):
            m += p
        return m

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Split `node` so that its first m tokens become a new parent; return that parent."""
        parent = node.parent
        assert parent is not None and 0 < m < len(node.key)
        head = RadixNode(node.key[:m], node.pages[: m // self.page_size], parent)
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        head.keys = node.keys[: m // self.page_size]
        node.keys = node.keys[m // self.page_size :]
        head.host, head.born = node.host[: m // self.page_size], node.born
        head.copied_at = node.copied_at
        node.host = node.host[m // self.page_size :]
        parent.children[tuple(node.key[: self.page_size])] = head
        node.key = node.key[m:]
        node.pages = node.pages[m // self.page_size :]
        node.parent = head
        head.children[tuple(node.key[: self.page_size])] = node
        self._offer(head)  # (a tiered tree's: its host copy can go)
        return head

    # -- updates -----------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Store tokens (page-aligned) with their pages; return how many leading tokens the
        tree already held on the device (the caller keeps ownership of its pages for those;
        host nodes past them take the caller's pages, as new nodes do)."""
        p = self.page_size
        assert len(tokens) % p == 0 and len(pages) == len(tokens) // p
        node, i, held = self.root, 0, None
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + p]))
            if child is None:
                new = RadixNode(list(tokens[i:]), list(pages[i // p :]), node)
                node.children[tuple(tokens[i : i + p])] = new
                self._account(new, +1)
                self._offer(new)
                self._came_in(new)
                if self.events is not None:
                    parent = self._last_key(node)
                    new.keys = page_keys(new.key, p, parent)
                    self.events.append(PageEvent(parent, new.keys))
                return i if held is None else held
            m = self._common_len(child.key, tokens, i)
            if m < len(child.key):
                child = self._split(child, m)
            if not child.pages:  # a host node: it takes the caller's pages
                held = i if held is None else held
                self.promote(child, list(pages[i // p : (i + m) // p]))
            child.last_access = next(_clock)
            node, i = child, i + m
        self._offer(node)
        return i if held is None else held

    def _account(self, node: RadixNode, sign: int) -> None:
        n = len(node.pages) * sign
        if node.lock_ref > 0:
            self.protected_pages += n
        else:
            self.evictable_pages += n

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                self._offer(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int, keep: bool = True) -> int:
        """Free at least `num_pages` device pages from unlocked leaves (of the device
        tier), least recently used first; `keep`: where the tree can, it keeps their KV
        elsewhere (`_keep_evicted`). Returns how many were freed (less if not enough are
        evictable)."""
        freed = 0
        for leaf in self.eviction_order(num_pages):
            pages = leaf.pages
            freed += len(pages)
            self.evictable_pages -= len(pages)
            # still a device node while the host makes room: never dropped from there
            kept = keep and self._keep_evicted(leaf, pages)
            leaf.pages = []
            if not kept:
                self._drop(leaf)
            self._free_pages(pages)
        return freed

    def eviction_order(self, num_pages: int) -> list[RadixNode]:
        """Unlocked device leaves, least recently used first, holding at least `num_pages`
        pages (fewer if the tree has fewer), in the order `evict` takes them: a parent
        follows once each of its device children is listed (as if evicted: a caller may
        look ahead without evicting). Their entries stay in the heap."""
        heap, out, taken = self._lru, [], []
        gone: set[RadixNode] = set()
        covered = 0
        while heap and covered < num_pages:
            entry = heapq.heappop(heap)
            leaf = entry[2]
            if leaf in gone or entry[0] != leaf.last_access or not self._leaf_after(leaf, gone):
                continue  # stale: the node has a newer entry, or gets one when it can
            taken.append(entry)
            out.append(leaf)
            gone.add(leaf)
            covered += len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            if parent is not self.root and self._leaf_after(parent, gone):
                heapq.heappush(heap, lru_entry(parent))
        for entry in taken:  # (stale once evicted)
            heapq.heappush(heap, entry)
        return out

    def _leaf_after(self, node: RadixNode, gone: set[RadixNode]) -> bool:
        """`node` is an unlocked device leaf once the nodes in `gone` leave the device."""
        return (
            node.lock_ref == 0
            and bool(node.pages)
            and all(c in gone or not c.pages for c in node.children.values())
        )

    def _offer(self, node: RadixNode) -> None:
        """An entry in the eviction heap for `node` if it is an unlocked device leaf now
        (overridden: a tiered tree's heap of host pages to drop)."""
        if node is not self.root and node.lock_ref == 0 and self._is_leaf(node):
            heapq.heappush(self._lru, lru_entry(node))
            if len(self._lru) > max(REBUILD, 4 * self._lru_built):
                # stale entries (touches, locks) outnumber live ones 3 to 1: drop them
                self._lru = [lru_entry(n) for n in self._leaves() if n.lock_ref == 0]
                heapq.heapify(self._lru)
                self._lru_built = len(self._lru)

    # -- hooks of a tiered tree -----------------------------------------------------------
    def _came_in(self, node: RadixNode) -> None:
        """`node`'s device pages have just entered the tree."""

    def promote(self, node: RadixNode, pages: list[int], load: bool = False) -> None:
        raise AssertionError("a host node in a tree without a host tier")

    def _keep_evicted(self, leaf: RadixNode, pages: list[int]) -> bool:
        """Keep an evicted leaf's KV (`pages`, still its own) elsewhere: False, dropped."""
        return False

    def _drop(self, leaf: RadixNode) -> None:
        """An evicted leaf (its device pages gone) leaves the tree."""
        self._unlink(leaf)

    def _unlink(self, node: RadixNode) -> RadixNode:
        """Take a node out of the tree (its pages already freed), with its event."""
        if self.events is not None:
            self.events.append(PageEvent(removed=node.keys))
        parent = node.parent
        assert parent is not None
        del parent.children[tuple(node.key[: self.page_size])]
        return parent

    def _is_leaf(self, node: RadixNode) -> bool:
        """A leaf of the device tier: on the device, no child there."""
        return bool(node.pages) and not any(c.pages for c in node.children.values())

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and self._is_leaf(node):
                out.append(node)
            # below a host node every node is on the host: a host tier's subtrees are skipped
            stack.extend(c for c in node.children.values() if c.pages)
        return out

    def all_nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def reset(self) -> None:
        """Free every page of the tree, on every tier (all nodes must be unlocked)."""
        self.drop_unlocked()

    def drop_unlocked(self) -> None:
        """Free every page no request holds, on every tier (a flush; after a failed step,
        pages it was computing may be in the tree with garbage in them)."""
        self.evict(self.evictable_pages, keep=False)

    def check_integrity(self) -> None:
        seen: set[int] = set()
        host_seen: set[int] = set()
        evictable = protected = 0
        for node in self.all_nodes():
            tier = node.pages or node.host
            assert tier and len(node.key) == len(tier) * self.page_size
            assert not node.host or len(node.host) == len(tier), "a partial host copy"
            assert self.events is None or len(node.keys) == len(tier)
            assert node.lock_ref >= 0
            for child in node.children.values():
                assert child.parent is node
                assert child.lock_ref <= node.lock_ref or node is self.root
                assert node.pages or not child.pages, "a device node below a host node"
            dup = seen.intersection(node.pages)
            assert not dup, f"pages {sorted(dup)} owned twice in the radix tree"
            seen.update(node.pages)
            dup = host_seen.intersection(node.host)
            assert not dup, f"host pages {sorted(dup)} owned twice in the radix tree"
            host_seen.update(node.host)
            if node.lock_ref > 0:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        assert evictable == self.evictable_pages, (evictable, self.evictable_pages)
        live = {id(n) for access, _, n in self._lru if access == n.last_access}
        for leaf in self._leaves():
            assert leaf.lock_ref > 0 or id(leaf) in live, "an evictable leaf not in the heap"
        assert protected == self.protected_pages, (protected, self.protected_pages)
        self._check_host_pages(host_seen)

    def _check_host_pages(self, owned: set[int]) -> None:
        assert not owned, "host pages in a tree without a host tier"

    def owned_pages(self) -> set[int]:
        return {p for node in self.all_nodes() for p in node.pages}

    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
