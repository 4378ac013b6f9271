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

from dataclasses import dataclass

import numpy as np

from baton.common.cache.allocator import OutOfPages, PageAllocator
from baton.common.cache.radix import RadixCache, RadixNode
from baton.common.cache.req_to_token import ReqToTokenTable
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
            pages, node = self.radix.match_prefix(self._matchable(req), record=True)
            self.radix.lock(node)
            req.node = node
            req.pages = list(pages)
        req.cached_len = req.device_len = len(req.pages) * self.page_size
        req.prefix_hit_tokens = req.cached_len
        if req.pages:
            self._stage(req, 0, req.device_len)

    def extend(self, req: Req, n: int) -> list[int]:
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
            self.radix.evict(self.radix.evictable_pages)

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
        staged, self.staged = self.staged, []
        return staged

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
