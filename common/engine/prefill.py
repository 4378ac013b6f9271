"""Prefill manager: the waiting queue, the schedule policy, admission and chunking.

Admission is by KV budget: a request enters only if its uncached prompt fits in the free
and evictable pages left after reserving room for the running decodes. At most one
request is mid-prompt (chunked) at a time; it continues first in the next step.
"""

from __future__ import annotations

import time
from collections import deque

from baton.common.cache.allocator import OutOfPages
from baton.common.cache.manager import CacheManager
from baton.common.config import Policy
from baton.common.engine.req import Req, ScheduledBatch


class PrefillManager:
    def __init__(
        self,
        cache: CacheManager,
        policy: Policy,
        token_budget: int,
        chunked: bool,
        max_running: int,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.token_budget = token_budget
        self.chunked = chunked
        self.max_running = max_running
        self.waiting: deque[Req] = deque()
        self.chunked_req: Req | None = None
        self.hit_tokens = 0  # prefix-cache hits at admission, cumulative
        self.admitted_tokens = 0  # prompt tokens admitted, cumulative

    def add(self, req: Req, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def remove(self, req: Req) -> bool:
        if self.chunked_req is req:
            self.chunked_req = None
            return True
        try:
            self.waiting.remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self.waiting) + (self.chunked_req is not None)

    def _ordered(self) -> list[Req]:
        reqs = list(self.waiting)
        if self.policy == "lpm" and len(reqs) > 1:
            reqs.sort(key=lambda r: -self.cache.prefix_len(r))
        return reqs

    def schedule(self, num_running: int, reserved_pages: int) -> ScheduledBatch | None:
        plan = ScheduledBatch([], [], [], [], [])
        budget = self.token_budget
        if self.chunked_req is not None:
            req = self.chunked_req
            self.chunked_req = None
            budget = self._add_chunk(plan, req, budget)
            if self.chunked_req is not None or budget <= 0:
                return plan if plan.reqs else None
        for req in self._ordered():
            if budget <= 0 or num_running + len(plan.reqs) >= self.max_running:
                break
            if self.cache.table.num_free == 0:
                break
            self.cache.admit(req)
            remaining = req.num_tokens - req.device_len
            need = self.cache.pages_for(req, remaining)
            if need + reserved_pages > self.cache.available_pages():
                self.cache.release(req, cache=False)
                break
            self.waiting.remove(req)
            req.times.setdefault("admitted", time.monotonic())
            self.hit_tokens += req.prefix_hit_tokens
            self.admitted_tokens += req.num_tokens
            budget = self._add_chunk(plan, req, budget)
            if self.chunked_req is not None:
                break
        return plan if plan.reqs else None

    def _add_chunk(self, plan: ScheduledBatch, req: Req, budget: int) -> int:
        remaining = req.num_tokens - req.device_len
        n = min(remaining, budget) if self.chunked else remaining
        prefix = req.device_len
        try:
            slots = self.cache.extend(req, n)
        except OutOfPages:
            # running decodes took the pages; try again next step (they may retract)
            self.chunked_req = req
            return 0
        last = n == remaining
        if not last:
            self.chunked_req = req
        self.cache.cache_prefix(req)
        plan.reqs.append(req)
        plan.extend_lens.append(n)
        plan.prefix_lens.append(prefix)
        plan.sample.append(last)
        plan.kv_slots.append(slots)
        return budget - n
