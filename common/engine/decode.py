"""Decode manager: the running batch, one KV slot per request per step, retraction.

Requests *reserved* for decoding (a decode worker's rooms whose KV is still arriving) count
like running ones: toward the running cap and toward the pages held back for decoding, so
a room admitted now never takes the pages a running request will need.

When the pool cannot give every running request its next slot (after evicting the prefix
cache), the newest requests are retracted: they release their KV (keeping their computed
pages in the prefix cache) and go back to the front of the waiting queue with prompt +
output so far, to be recomputed later. A request that still finds no page waits a step;
a full pool never fails a step. A retracted request's memory goes through the role's
`keep_memory` hook first, as a failed step's does: a transfer still reading its pages (a
live migration's pre-copy) keeps them out of the pool until its room ends.
"""

from __future__ import annotations

from collections.abc import Callable

from baton.common.cache.manager import CacheManager, HeldMemory
from baton.common.state import Req, ScheduledBatch, ScheduledItem


class NeedSync(Exception):
    """Retraction needs every in-flight token on the host first."""


def _keep_nothing(req: Req, held: HeldMemory) -> bool:
    return False


class DecodeManager:
    def __init__(
        self,
        cache: CacheManager,
        reserve_tokens: int,
        keep_memory: Callable[[Req, HeldMemory], bool] = _keep_nothing,
    ) -> None:
        self.cache = cache
        self.reserve_tokens = reserve_tokens
        self.keep_memory = keep_memory  # the role's hook (`SchedulerHooks.keep_memory`)
        self.running: list[Req] = []
        self.reserved: list[Req] = []  # admitted here, waiting for their KV to arrive
        self.num_retracted = 0

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.reserved)

    def add(self, req: Req) -> None:
        if req in self.reserved:
            self.reserved.remove(req)
        self.running.append(req)

    def reserve(self, req: Req) -> None:
        self.reserved.append(req)

    def remove(self, req: Req) -> bool:
        for group in (self.running, self.reserved):
            if req in group:
                group.remove(req)
                return True
        return False

    def reserve_tokens_for(self, req: Req) -> int:
        """Tokens `req` may still decode, up to `reserve_tokens`."""
        return max(min(req.sampling.max_new_tokens - req.output_len, self.reserve_tokens), 0)

    def reserve_for(self, req: Req) -> int:
        """Pages held back so `req` (admitted, all its KV allocated) can keep decoding."""
        return max(self.cache.pages_for(req, self.reserve_tokens_for(req)), 0)

    def reserved_pages(self) -> int:
        """Pages held back from admission for the running and reserved requests."""
        return sum(self.reserve_for(r) for r in self.running) + sum(
            self.reserve_for(r) for r in self.reserved
        )

    def decodable(self) -> list[Req]:
        return [
            r for r in self.running if not r.finished and r.output_len < r.sampling.max_new_tokens
        ]

    def schedule(self, plan: ScheduledBatch, has_unprocessed: bool) -> list[Req]:
        """Give each decodable request one KV slot in `plan`, retracting the newest while
        the pool is short. Returns the retracted requests (the caller requeues them)."""
        reqs = self.decodable()
        need = sum(self.cache.pages_for(r, 1) for r in reqs)
        retract: list[Req] = []
        while need > self.cache.available_pages() and len(reqs) > 1:
            victim = reqs.pop()
            need -= self.cache.pages_for(victim, 1)
            retract.append(victim)
        if retract:
            if has_unprocessed:
                raise NeedSync
            for victim in retract:
                self._retract(victim)
        for r in reqs:
            if self.cache.pages_for(r, 1) > self.cache.available_pages():
                continue  # reserved rooms hold the pages: it waits for one to free
            start = r.device_len
            plan.items.append(ScheduledItem(r, start, 1, True, self.cache.extend(r, 1)))
        return retract

    def _retract(self, req: Req) -> None:
        self.cache.cache_prefix(req)  # its computed pages stay cached for the recompute
        held = self.cache.take(req)
        if not self.keep_memory(req, held):
            self.cache.release_held(held)
        self.running.remove(req)
        self.num_retracted += 1
        if req.trace is not None:
            req.trace.retracted()
