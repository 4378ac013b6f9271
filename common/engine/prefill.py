"""Prefill manager: the waiting queue, the schedule policy and chunking.

Requests enter through `Admission` (KV budget). At most one request is mid-prompt
(chunked) at a time; it continues first in the next step. A *suspect* (a request that was
in a step that failed) is computed alone, so a failure is traced to the request that
causes it.
"""

from __future__ import annotations

import time
from collections import deque

from baton.common.cache.allocator import OutOfPages
from baton.common.cache.manager import CacheManager
from baton.common.config import Policy
from baton.common.engine.admission import Admission
from baton.common.engine.step_clock import StepBudget
from baton.common.state import Req, ScheduledBatch, ScheduledItem


class PrefillManager:
    def __init__(
        self,
        cache: CacheManager,
        admission: Admission,
        policy: Policy,
        token_budget: int,
        chunked: bool,
    ) -> None:
        self.cache = cache
        self.admission = admission
        self.policy = policy
        self.token_budget = token_budget
        self.chunked = chunked
        self.waiting: deque[Req] = deque()
        self.chunked_req: Req | None = None
        self.hit_tokens = 0  # prefix-cache hits at admission, cumulative
        self.admitted_tokens = 0  # prompt tokens admitted, cumulative

    def add(self, req: Req, front: bool = False) -> None:
        """`front`: a request that had its pages (retracted, requeued after a failed step)
        goes first, and is owed pages before any room is reserved."""
        if front:
            req.short_of_pages = True
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def remove(self, req: Req) -> bool:
        if self.chunked_req is req:
            self.chunked_req = None
            return True
        if req not in self.waiting:  # (deque.remove's error would format the request whole)
            return False
        self.waiting.remove(req)
        return True

    def __len__(self) -> int:
        return len(self.waiting) + (self.chunked_req is not None)

    def short_of_memory(self) -> bool:
        """A request here waits for pages: it had some (retracted, requeued), or admission
        or a chunk found none; until its last chunk has them. One that waits only for its
        turn, or for a decode worker's TPOT slack (a local prompt), is not: rooms may go
        ahead of it."""
        chunked = self.chunked_req is not None and self.chunked_req.short_of_pages
        return chunked or any(r.short_of_pages for r in self.waiting)

    def next_is_suspect(self) -> bool:
        return self.chunked_req is None and any(r.suspect for r in self.waiting)

    def _ordered(self) -> list[Req]:
        reqs = list(self.waiting)
        suspects = [r for r in reqs if r.suspect]
        if suspects:
            return suspects[:1]
        if self.policy == "lpm" and len(reqs) > 1:
            reqs.sort(key=lambda r: -self.cache.prefix_len(r))
        return reqs

    def schedule(self, plan: ScheduledBatch, cap: StepBudget | None = None) -> None:
        """Add this step's prefill chunks to `plan` (empty: nothing to prefill). `cap`: a
        role's bound on this step's prompt tokens, chunking whatever the configuration."""
        budget = self.token_budget
        chunked = self.chunked or cap is not None
        if budget <= 0 or (cap is not None and cap.empty):
            return
        if self.chunked_req is not None:
            req = self.chunked_req
            self.chunked_req = None
            budget = self._add_chunk(plan, req, budget, chunked, cap)
            if self.chunked_req is not None or budget <= 0:
                return
        for req in self._ordered():
            if budget <= 0:
                break
            if not self.admission.try_admit(req, scheduled=len(plan.items)):
                req.short_of_pages = True
                break
            self.waiting.remove(req)
            req.times.setdefault("admitted", time.monotonic())
            self.hit_tokens += req.prefix_hit_tokens
            self.admitted_tokens += req.num_tokens
            budget = self._add_chunk(plan, req, budget, chunked, cap)
            if req.suspect:
                plan.solo = bool(plan.items)
                break
            if self.chunked_req is not None:
                break

    def _add_chunk(
        self, plan: ScheduledBatch, req: Req, budget: int, chunked: bool, cap: StepBudget | None
    ) -> int:
        remaining = req.num_tokens - req.device_len
        n = min(remaining, budget) if chunked else remaining
        prefix = req.device_len
        if cap is not None:
            n = cap.take(n, prefix)
            if n <= 0:  # its context leaves no room this step: it goes on first next step
                self.chunked_req = req
                return 0
        try:
            slots = self.cache.extend(req, n)
        except OutOfPages:
            # running decodes took the pages; try again next step (they may retract)
            req.short_of_pages = True
            self.chunked_req = req
            return 0
        last = n == remaining
        if last:  # owed pages until its whole prompt has them
            req.short_of_pages = False
        if not last:
            self.chunked_req = req
        self.cache.cache_prefix(req, writing_from=prefix)
        plan.items.append(ScheduledItem(req, prefix, n, last, slots))
        return budget - n
