"""Decode manager: the running batch, one KV slot per request per step, retraction.

When the pool cannot give every running request its next slot (after evicting the
prefix cache), the newest requests are retracted: they release their KV (keeping their
computed pages in the prefix cache) and go back to the front of the waiting queue with
prompt + output so far, to be recomputed later. A request that fits alone never fails.
"""

from __future__ import annotations

from baton.common.cache.manager import CacheManager
from baton.common.engine.req import Req


class NeedSync(Exception):
    """Retraction needs every in-flight token on the host first."""


class DecodeManager:
    def __init__(self, cache: CacheManager, reserve_tokens: int) -> None:
        self.cache = cache
        self.reserve_tokens = reserve_tokens
        self.running: list[Req] = []
        self.num_retracted = 0

    def add(self, req: Req) -> None:
        self.running.append(req)

    def remove(self, req: Req) -> bool:
        try:
            self.running.remove(req)
            return True
        except ValueError:
            return False

    def reserved_pages(self) -> int:
        """Pages held back from admission so running requests can keep decoding."""
        p = self.cache.page_size
        total = 0
        for r in self.running:
            left = min(r.sampling.max_new_tokens - r.output_len, self.reserve_tokens)
            total += max(-(-max(left, 0) // p), 0)
        return total

    def decodable(self) -> list[Req]:
        return [
            r for r in self.running if not r.finished and r.output_len < r.sampling.max_new_tokens
        ]

    def schedule(self, has_unprocessed: bool) -> tuple[list[tuple[Req, list[int]]], list[Req]]:
        """Allocate one slot per decodable request; retract the newest if short.
        Returns (request, its new KV slot) pairs and the retracted requests."""
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
        return [(r, self.cache.extend(r, 1)) for r in reqs], retract

    def _retract(self, req: Req) -> None:
        self.cache.release(req, cache=True)
        self.running.remove(req)
        self.num_retracted += 1
