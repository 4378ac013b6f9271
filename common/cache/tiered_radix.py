"""A radix tree whose evicted pages go to a host-memory tier (`host_tier.py`).

An evicted leaf keeps its node: its KV is copied to the host pool and its tier mark set
(`pages` empty, `host` pages), so below a host node every node is on the host. A request
finds the host nodes that continue its device match with `host_path` and loads them back
with `promote(load=True)`; an insert covering host nodes gives them its pages instead. The
host pool drops its least recently used unlocked leaves when full (a 64th of it at once); a
device node's write-through copy (`--host-kv-write through`) goes first. What can go is
kept in a heap by last access, as the device's eviction order is (`radix.py`), so a drop
costs the nodes it drops, not a walk of the tree; an entry older than its node's last
access is pushed again with the newer one when met, so touches need no entry. KV events say
when a node's pages go to the host (`to_host`: an eviction keeping them) and come back
(`to_device`: a load, or an insert covering them); a page is removed only when it leaves
the host too, so the router counts host hits at their lower value (`kv_index.py`).

Copies ahead: at each launch the next pages in eviction order (least recently used
unlocked leaves) get a host copy while they stay in the tree, as many as the evictions of
the last `AHEAD_WINDOW` launches' busiest one, twice over (at most an eighth of the pool).
Their copies run beside the step (`host_tier`), their eviction later copies nothing and
only fences the step that takes their pages; a hit meanwhile reads them as before.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from baton.common.cache.host_tier import HostTier
from baton.common.cache.kv_pool import KVPool
from baton.common.cache.radix import REBUILD, RadixCache, RadixNode, lru_entry, touch
from baton.common.kv_events import PageEvent

DROP_AHEAD = 64  # a full host tier frees this share of itself at once (1/64)
AHEAD_WINDOW = 8  # launches whose evictions size the copies ahead
AHEAD_STEPS = 2  # copies ahead cover this many of the busiest launch's evictions
AHEAD_SHARE = 8  # and at most this share of the device pool (1/8)


class TieredRadixCache(RadixCache):
    tier: HostTier

    def __init__(
        self, page_size: int, free_pages: Callable[[list[int]], None], tier: HostTier
    ) -> None:
        super().__init__(page_size, free_pages)
        self.tier = tier
        self.launches = 0  # steps launched (`queue_copies`), to date copies of computed pages
        self._backups: list[RadixNode] = []  # write-through: nodes whose copy is due
        self._evicted = 0  # device pages evicted since the last launch
        self._demand: deque[int] = deque(maxlen=AHEAD_WINDOW)  # per launch, the last few
        self.ahead_limit = len(tier.device_buffer) // AHEAD_SHARE
        # (last access, tie, node): each node whose host pages can go has one at or before
        # its last access (`_droppable`), among stale ones
        self._host_lru: list[tuple[int, int, RadixNode]] = []
        self._host_lru_built = 0  # its size at the last rebuild

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
        earliest: dict[int, int] = {}
        for access, _, node in self._host_lru:
            earliest[id(node)] = min(access, earliest.get(id(node), access))
        for node in self.all_nodes():
            if self._droppable(node):
                assert earliest.get(id(node), node.last_access + 1) <= node.last_access
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
        node.pages, node.copied_at = pages, 0  # no copy reads these pages
        if self.events is not None:
            self.events.append(PageEvent(to_device=list(node.keys)))
        self._account(node, +1)
        self._came_in(node)
        self._offer(node)

    def queue_copies(self) -> None:
        """At each step's launch: queue the host copies of device pages that stay in the
        tree, of pages that came in two launches ago or more (computed by now, see
        `host_tier`): write-through copies, and copies ahead of the next evictions."""
        self.launches += 1
        due = [n for n in self._backups if n.born + 2 <= self.launches]
        self._backups = [n for n in self._backups if n.born + 2 > self.launches]
        for node in due:
            if node.pages and not node.host:  # (else gone, evicted, or copied since)
                self._copy(node)  # where the host has no room: copied on eviction instead
        self._demand.append(self._evicted)
        self._evicted = 0
        self._copy_ahead(min(self.ahead_limit, AHEAD_STEPS * max(self._demand)))

    def _copy_ahead(self, num_pages: int) -> None:
        """Give the next `num_pages` pages in eviction order a host copy where they have
        none (and are computed)."""
        if num_pages <= 0:
            return
        for leaf in self.eviction_order(num_pages):
            if not leaf.host and leaf.born + 2 <= self.launches and not self._copy(leaf):
                break

    def _copy(self, node: RadixNode) -> bool:
        """Queue a host copy of a device node's pages, which stay in the tree."""
        host = self._host_alloc(len(node.pages))
        if host is None:
            return False
        self.tier.offload(node.pages, host, ahead=True)
        node.host, node.copied_at = host, self.launches
        self._offer_host(node)
        return True

    def evict(self, num_pages: int, keep: bool = True) -> int:
        freed = super().evict(num_pages, keep)
        if keep:  # (not a flush)
            self._evicted += freed
        return freed

    def _host_alloc(self, n: int) -> list[int] | None:
        short = n - self.tier.allocator.num_free
        if short > 0:
            # make room for the next offloads too (1/64 of the host), not one drop per
            # evicted page while the host stays full
            self._drop_host(max(short, self.tier.num_pages // DROP_AHEAD))
        if n > self.tier.allocator.num_free:
            return None
        return self.tier.allocator.alloc(n)

    def _drop_host(self, num_pages: int) -> int:
        """Free host pages, least recently used first: unlocked host leaves leave the tree,
        device nodes lose their write-through copy or copy ahead."""
        heap, freed = self._host_lru, 0
        while freed < num_pages and heap:
            access, _, node = heapq.heappop(heap)
            if not self._droppable(node):
                continue  # stale: it gets a new entry if it can go again
            if access != node.last_access:
                heapq.heappush(heap, lru_entry(node))  # used since: its place is later
                continue
            self.tier.allocator.free(node.host)
            freed += len(node.host)
            self.tier.counters.dropped_pages += len(node.host)
            node.host = []
            if node.pages:
                continue
            parent = self._unlink(node)
            if parent is not self.root and self._droppable(parent):
                heapq.heappush(heap, lru_entry(parent))
        return freed

    def _droppable(self, node: RadixNode) -> bool:
        """`node`'s host pages can go: a device node's copy, or an unlocked host leaf's."""
        return bool(node.host) and (bool(node.pages) or (not node.children and node.lock_ref == 0))

    def _offer(self, node: RadixNode) -> None:
        super()._offer(node)
        self._offer_host(node)

    def _offer_host(self, node: RadixNode) -> None:
        """An entry in the heap of host pages to drop for `node`, if they can go now."""
        if self._droppable(node):
            heapq.heappush(self._host_lru, lru_entry(node))
            if len(self._host_lru) > max(REBUILD, 4 * self._host_lru_built):
                nodes = self.all_nodes()
                self._host_lru = [lru_entry(n) for n in nodes if self._droppable(n)]
                heapq.heapify(self._host_lru)
                self._host_lru_built = len(self._host_lru)

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
        kept = self._to_host(leaf, pages)
        if kept and self.events is not None:
            self.events.append(PageEvent(to_host=list(leaf.keys)))
        return kept

    def _to_host(self, leaf: RadixNode, pages: list[int]) -> bool:
        if leaf.host:  # copied already (through or ahead): the step taking `pages` waits for it
            if leaf.copied_at:
                self.tier.fence(leaf.copied_at)
            return True
        host = self._host_alloc(len(pages))
        if host is None:
            return False
        self.tier.offload(pages, host)
        leaf.host = host
        self._offer_host(leaf)
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
