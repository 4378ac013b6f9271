"""Request-level memory: prefix matching, page allocation, caching and release.

A request's KV regions, by position:

    0            cached_len          aligned_len         device_len
    |  tree pages  |  own full pages   |  own tail page    |
    |  (locked)    |  (inserted into   |  (unaligned, the |
    |              |   the tree after  |   request's own) |
    |              |   each chunk)     |                  |

`cache_prefix` moves full pages into the tree (the request then holds them through its
locked node); pages the tree already had are the request's duplicates and are freed
here, so no page is freed twice or leaked. Table writes are staged and applied by the
model runner at the start of the next step (in step order), so a step already in
flight never sees the table change under it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from baton.common.cache.allocator import OutOfPages, PageAllocator
from baton.common.cache.page_moves import PageMoves
from baton.common.cache.radix import RadixCache, RadixNode
from baton.common.cache.req_to_token import ReqToTokenTable
from baton.common.cache.tiered_radix import TieredRadixCache
from baton.common.devices import Ints
from baton.common.state import Req


@dataclass
class HeldMemory:
    """A request's memory detached from it: its table row, its own pages, and its lock on
    the prefix-cache node that holds the rest."""

    slot: int
    pages: list[int]
    node: RadixNode | None


class CacheManager:
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        table: ReqToTokenTable,
        radix: RadixCache | None,
    ) -> None:
        self.page_size = page_size
        self.allocator = allocator
        self.table = table
        self.radix = radix
        self.staged: list[tuple[int, int, Ints]] = []  # (slot, start, kv slots)

    # -- queries -----------------------------------------------------------------------
    def prefix_len(self, req: Req) -> int:
        if self.radix is None:
            return 0
        pages, _ = self.radix.match_prefix(self._matchable(req))
        return len(pages) * self.page_size

    def available_pages(self) -> int:
        evictable = self.radix.evictable_pages if self.radix is not None else 0
        return self.allocator.num_free + evictable

    def pages_for(self, req: Req, n: int) -> int:
        """New pages needed to extend `req` by n tokens."""
        return -(-(req.device_len + n) // self.page_size) - len(req.pages)

    def pages_in_use(self) -> int:
        cached = self.radix.total_pages if self.radix is not None else 0
        return self.allocator.num_pages - self.allocator.num_free - cached

    # -- lifecycle ---------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Give `req` a table row and lock the longest cached prefix of its tokens."""
        assert req.slot is None and not req.pages
        req.slot = self.table.alloc()
        if self.radix is not None:
            tokens = self._matchable(req)
            pages, node = self.radix.match_prefix(tokens, record=True)
            self.radix.lock(node)
            if isinstance(self.radix, TieredRadixCache) and self._load(tokens, node, len(pages)):
                pages, node = self.radix.match_prefix(tokens)
            req.node = node
            req.pages = list(pages)
        req.cached_len = req.device_len = len(req.pages) * self.page_size
        req.prefix_hit_tokens = req.cached_len
        if req.pages:
            self._stage(req, 0, req.device_len)

    def _load(self, tokens: list[int], node: RadixNode, num_pages: int) -> bool:
        """Load the host-tier nodes that continue the prefix locked at `node` into fresh
        device pages, as far as the pool has room (the copies run before the next step's
        forward). Leaves the lock on the last node loaded; True if any was."""
        assert isinstance(self.radix, TieredRadixCache)
        path = self.radix.host_path(tokens, node, num_pages * self.page_size)
        if not path:
            return False
        self.radix.lock(path[-1])  # no eviction, on either tier, takes the path meanwhile
        self.radix.unlock(node)
        last = node
        for host_node in path:
            need = len(host_node.host)
            if need > self.allocator.num_free:
                self.radix.evict(need - self.allocator.num_free)
            if need > self.allocator.num_free:
                break
            self.radix.promote(host_node, self.allocator.alloc(need), load=True)
            last = host_node
        if last is not path[-1]:
            self.radix.lock(last)
            self.radix.unlock(path[-1])
        return last is not node

    def take_page_moves(self) -> PageMoves | None:
        """The host-tier copies the step being launched runs before its forward."""
        if not isinstance(self.radix, TieredRadixCache):
            return None
        self.radix.queue_copies()
        return self.radix.tier.take_moves(self.radix.launches)

    def has_page_moves(self) -> bool:
        return self.radix is not None and self.radix.tier is not None and self.radix.tier.queued

    def run_page_moves(self) -> None:
        """Run the queued host-tier copies now and wait for them (outside a step: before
        pages go to a writer that is not a step, a decode worker's peer)."""
        if isinstance(self.radix, TieredRadixCache):
            self.radix.tier.run_queued()

    def extend(self, req: Req, n: int) -> Ints:
        """Allocate KV for the next n tokens of `req`; return their KV slots."""
        need = self.pages_for(req, n)
        if need > 0:
            self.ensure_free(need)
            req.pages.extend(self.allocator.alloc(need))
        start = req.device_len
        req.device_len += n
        return self._stage(req, start, n)

    def ensure_free(self, need: int) -> None:
        short = need - self.allocator.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        if need > self.allocator.num_free:
            raise OutOfPages(f"need {need} pages, {self.allocator.num_free} free")

    def cache_prefix(self, req: Req, writing_from: int | None = None) -> None:
        """Insert the request's full pages into the tree and re-own them through it.

        `writing_from`: the first position whose KV the step being scheduled computes.
        Where the tree already holds a page from that position's page on, nothing from
        there is inserted yet: the request would free its own copy and take the tree's,
        but the step writes its own copy, and a page freed now may be handed to another
        request of the same step, whose KV would go to the same slots (on a GPU which
        write lands is undefined: cached prompts came out as other tokens, 2026-11-27).
        Those pages go in once computed (the next chunk, or joining the decode batch)."""
        if self.radix is None or req.computes_prompt_logprobs:
            # A request that did not read the tree must not swap its pages for the tree's
            # while its prompt is being computed (the step writes the slots it was given);
            # its pages go in once its first token exists.
            return
        known = min(req.device_len, len(req.input_ids) + len(req.output_ids))
        aligned = known - known % self.page_size
        if writing_from is not None:
            safe = writing_from - writing_from % self.page_size
            if aligned > safe:
                held, _ = self.radix.match_prefix(req.fill_ids[:aligned])
                if len(held) * self.page_size > safe:
                    aligned = safe
        if aligned <= req.cached_len:
            return
        tokens = req.fill_ids[:aligned]
        n_pages = aligned // self.page_size
        already = self.radix.insert(tokens, req.pages[:n_pages])
        self.allocator.free(req.pages[req.cached_len // self.page_size : already // self.page_size])
        pages, node = self.radix.match_prefix(tokens)
        assert len(pages) == n_pages, "inserted prefix must match in full"
        changed = pages != req.pages[:n_pages]
        req.pages[:n_pages] = pages
        self.radix.lock(node)
        if req.node is not None:
            self.radix.unlock(req.node)
        req.node = node
        req.cached_len = aligned
        if changed:
            self._stage(req, 0, aligned)

    def release(self, req: Req, cache: bool = True) -> None:
        """Free everything `req` holds (idempotent). With `cache`, its computed full pages
        stay in the prefix cache for later requests."""
        if req.slot is None:
            return
        if cache:
            self.cache_prefix(req)
        self.release_held(self.take(req))

    def take(self, req: Req) -> HeldMemory:
        """Detach `req`'s memory, leaving `req` as if never admitted; the caller frees the
        result with `release_held`."""
        assert req.slot is not None
        # the row is given up: table writes still staged for it belong to no step, and
        # would land together with its next owner's
        self.staged = [w for w in self.staged if w[0] != req.slot]
        held = HeldMemory(req.slot, req.pages[req.cached_len // self.page_size :], req.node)
        req.slot, req.node, req.pages = None, None, []
        req.cached_len = req.device_len = 0
        return held

    def release_held(self, held: HeldMemory) -> None:
        self.allocator.free(held.pages)
        if self.radix is not None and held.node is not None:
            self.radix.unlock(held.node)
        self.table.free(held.slot)

    def drop_unlocked(self) -> None:
        """Evict every prefix-cache page no request holds (after a failed step, pages it
        was computing may be in the tree with garbage in them)."""
        if self.radix is not None:
            self.radix.drop_unlocked()

    # -- helpers -----------------------------------------------------------------------
    def _matchable(self, req: Req) -> list[int]:
        if req.computes_prompt_logprobs:  # every prompt position's logits are needed
            return []
        # at least one token must be computed, to produce the logits of the next one
        ids = req.fill_ids
        return ids[: len(ids) - 1]

    def _stage(self, req: Req, start: int, n: int) -> Ints:
        """KV slots of positions start..start+n-1 of `req`, staged for the req-to-token
        table: a list of one for a decode step, else a numpy array (a prompt's step stages
        thousands, before its forward can start; they stay in numpy up to the upload)."""
        p = self.page_size
        if n == 1:  # a decode step
            slots: Ints = [req.pages[start // p] * p + start % p]
        else:
            first, last = start // p, (start + n - 1) // p
            pages = np.asarray(req.pages[first : last + 1], dtype=np.int64)
            cells = (pages[:, None] * p + np.arange(p)).ravel()
            slots = cells[start - first * p : start - first * p + n]
        assert req.slot is not None
        self.staged.append((req.slot, start, slots))
        return slots

    def take_staged(self) -> list[tuple[int, int, Ints]]:
        """The table writes staged since the last step, in effect: where writes to one
        row overlap (a request admitted onto the tree's pages, then swapped to other
        pages of the tree before its step ran), the later one wins. The step scatters
        them all at once, and on a GPU which of two writes to one cell lands is
        undefined."""
        staged, self.staged = self.staged, []
        rows = [row for row, _, _ in staged]
        if len(set(rows)) == len(rows):
            return staged
        by_row: dict[int, list[tuple[int, int, Ints]]] = {}
        for write in staged:
            by_row.setdefault(write[0], []).append(write)
        return [w for writes in by_row.values() for w in _later_wins(writes)]

    def check_integrity(self, live: list[Req]) -> None:
        self.allocator.check_integrity()
        self.table.check_integrity()
        owners: dict[int, str] = {}
        tree_pages = set()
        if self.radix is not None:
            self.radix.check_integrity()
            tree_pages = self.radix.owned_pages()
            for page in tree_pages:
                owners[page] = "tree"
        for req in live:
            for page in req.pages[req.cached_len // self.page_size :]:
                assert page not in owners, f"page {page} owned by {req.rid} and {owners[page]}"
                owners[page] = req.rid
            for page in req.pages[: req.cached_len // self.page_size]:
                assert page in tree_pages, f"{req.rid} reads page {page} the tree does not hold"
        for page in owners:
            assert not self.allocator.is_free(page), f"page {page} is owned and free"
        total = self.allocator.num_free + len(owners)
        assert total == self.allocator.num_pages, (
            f"pages leaked: {self.allocator.num_pages - total} of {self.allocator.num_pages}"
        )


def _later_wins(writes: list[tuple[int, int, Ints]]) -> list[tuple[int, int, Ints]]:
    """Writes to one table row, in order, as writes of what the row holds after them
    all: one per run of cells they cover."""
    if len(writes) == 1:
        return writes
    lo = min(start for _, start, _ in writes)
    hi = max(start + len(values) for _, start, values in writes)
    cells = np.full(hi - lo, -1, dtype=np.int64)  # KV slots are >= 0
    for _, start, values in writes:
        cells[start - lo : start - lo + len(values)] = values
    covered = np.flatnonzero(cells >= 0)
    if not len(covered):
        return []
    breaks = np.flatnonzero(np.diff(covered) > 1) + 1
    row = writes[0][0]
    return [(row, lo + int(run[0]), cells[run]) for run in np.split(covered, breaks)]


def check_step_writes(kv_slots: list[Ints], table_writes: list[tuple[int, int, Ints]]) -> None:
    """Raise if a step writes one KV slot twice (two requests' KV would go to the same
    place) or two values into one table cell (`ReqToTokenTable.write_many` scatters them
    at once). On a GPU which of two such writes lands is undefined; on a CPU the last one
    does, which hides the fault: tests run with BATON_CHECK_STEPS=1 (tests/conftest.py)."""
    arrays = [np.asarray(s, dtype=np.int64) for s in kv_slots]
    slots = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
    if len(np.unique(slots)) != len(slots):
        raise AssertionError(f"a step writes a KV slot twice: {len(slots)} slots")
    spans = sorted((row, start, start + len(values)) for row, start, values in table_writes)
    if not any(a[0] == b[0] and b[1] < a[2] for a, b in itertools.pairwise(spans)):
        return
    cells = np.concatenate(
        [row * (1 << 32) + start + np.arange(len(v)) for row, start, v in table_writes]
    )
    values = np.concatenate([np.asarray(v, dtype=np.int64) for _, _, v in table_writes])
    order = np.lexsort((values, cells))
    cells, values = cells[order], values[order]
    clash = (cells[1:] == cells[:-1]) & (values[1:] != values[:-1])
    if clash.any():
        row, at = divmod(int(cells[1:][clash][0]), 1 << 32)
        raise AssertionError(f"a step writes two values into table row {row} at {at}: {spans}")
