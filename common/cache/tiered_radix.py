"""A radix tree whose evicted pages go to a host-memory tier (`host_tier.py`).

An evicted leaf keeps its node: its KV is copied to the host pool and its tier mark set
(`pages` empty, `host` pages), so below a host node every node is on the host. A request
finds the host nodes that continue its device match with `host_path` and loads them back
with `promote(load=True)`; an insert covering host nodes gives them its pages instead. The
host pool drops its least recently used unlocked leaves when full (a 64th of it at once); a
device node's write-through copy (`--host-kv-write through`) goes first. KV events say
nothing of tiers: a page is removed only when it leaves the host too.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from baton.common.cache.host_tier import HostTier
from baton.common.cache.kv_pool import KVPool
from baton.common.cache.radix import RadixCache, RadixNode, touch

DROP_AHEAD = 64  # a full host tier frees this share of itself at once (1/64)


class TieredRadixCache(RadixCache):
    tier: HostTier

    def __init__(
        self, page_size: int, free_pages: Callable[[list[int]], None], tier: HostTier
    ) -> None:
        super().__init__(page_size, free_pages)
        self.tier = tier
        self.launches = 0  # steps launched (`queue_backups`), to date write-through copies
        self._backups: list[RadixNode] = []  # write-through: nodes whose copy is due

    def _came_in(self, node: RadixNode) -> None:
        node.born = self.launches
        if self.tier.write_through:
            self._backups.append(node)

    def _drop(self, leaf: RadixNode) -> None:
        if leaf.host:
            self.tier.allocator.free(leaf.host)
            leaf.host = []
        self._drop_host_below(leaf)
        super()._drop(leaf)

    def drop_unlocked(self) -> None:
        super().drop_unlocked()
        self._drop_host(self.tier.num_pages)

    def _check_host_pages(self, owned: set[int]) -> None:
        self.tier.allocator.check_integrity()
        assert not any(self.tier.allocator.is_free(h) for h in owned)
        assert len(owned) == self.tier.pages_used, (
            f"host pages leaked: {self.tier.pages_used - len(owned)}"
        )

    # -- the host tier ------------------------------------------------------------------
    def host_path(self, tokens: Sequence[int], node: RadixNode, start: int) -> list[RadixNode]:
        """The host nodes that continue `tokens` below `node` (which holds its first
        `start`), split where `tokens` leave them."""
        p = self.page_size
        path, i = [], start
        n = len(tokens) - len(tokens) % p
        while i < n:
            child = node.children.get(tuple(tokens[i : i + p]))
            if child is None:
                break
            assert not child.pages, "a device node below a matched prefix's last node"
            m = self._common_len(child.key, tokens, i)
            if m < len(child.key):
                child = self._split(child, m)
            touch(child)
            path.append(child)
            node, i = child, i + m
        return path

    def promote(self, node: RadixNode, pages: list[int], load: bool = False) -> None:
        """Bring a host node back to the device in `pages`: loaded from its host copy
        (`load`), or given by `insert` (the caller computed them)."""
        assert not node.pages and len(pages) == len(node.host)
        if load:
            self.tier.load(node.host, pages, self.page_size)
        if not self.tier.write_through:  # through: the host copy stays, a later evict is free
            self.tier.allocator.free(node.host)
            node.host = []
        node.pages = pages
        self._account(node, +1)
        self._came_in(node)

    def queue_backups(self) -> None:
        """At each step's launch: queue the write-through copies of pages that came in two
        launches ago or more (computed by now, see `host_tier`)."""
        self.launches += 1
        due = [n for n in self._backups if n.born + 2 <= self.launches]
        self._backups = [n for n in self._backups if n.born + 2 > self.launches]
        for node in due:
            if not node.pages or node.host:  # gone, evicted, or copied since
                continue
            host = self._host_alloc(len(node.pages))
            if host is None:
                continue  # copied on eviction instead, if there is room then
            self.tier.offload(node.pages, host)
            node.host = host

    def _host_alloc(self, n: int) -> list[int] | None:
        short = n - self.tier.allocator.num_free
        if short > 0:
            # a drop scans the whole tree: make room for the next offloads too (1/64 of the
            # host), not one scan per evicted page while the host stays full
            self._drop_host(max(short, self.tier.num_pages // DROP_AHEAD))
        if n > self.tier.allocator.num_free:
            return None
        return self.tier.allocator.alloc(n)

    def _drop_host(self, num_pages: int) -> int:
        """Free host pages, least recently used first: unlocked host leaves leave the tree,
        device nodes lose their write-through copy."""
        heap = [
            n
            for n in self.all_nodes()
            if n.host and (n.pages or (not n.children and n.lock_ref == 0))
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)
            self.tier.allocator.free(node.host)
            freed += len(node.host)
            self.tier.counters.dropped_pages += len(node.host)
            node.host = []
            if node.pages:
                continue
            parent = self._unlink(node)
            host_leaf = not parent.pages and not parent.children and parent.lock_ref == 0
            if parent is not self.root and host_leaf:
                heapq.heappush(heap, parent)
        return freed

    def _drop_host_below(self, node: RadixNode) -> None:
        """Drop the host nodes below a device node leaving the tree."""
        for child in list(node.children.values()):
            self._drop_host_below(child)
            assert not child.pages
            self.tier.allocator.free(child.host)
            child.host = []
            self._unlink(child)

    def _keep_evicted(self, leaf: RadixNode, pages: list[int]) -> bool:
        """Keep an evicted leaf's KV on the host tier; False if the host has no room."""
        if leaf.host:  # write-through: copied already
            return True
        host = self._host_alloc(len(pages))
        if host is None:
            return False
        self.tier.offload(pages, host)
        leaf.host = host
        return True


def prefix_cache(
    page_size: int,
    free_pages: Callable[[list[int]], None],
    pool: KVPool,
    host_pages: int,
    write_through: bool,
) -> RadixCache:
    """A worker's prefix cache: with a host-memory tier of `host_pages` pages when it has one
    (`--host-kv-tokens`), else the GPU pool's alone."""
    if not host_pages:
        return RadixCache(page_size, free_pages)
    tier = HostTier(pool.buffer, host_pages, write_through=write_through)
    return TieredRadixCache(page_size, free_pages, tier)
