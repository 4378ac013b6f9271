"""Admission by KV budget: the one routine that lets a request into the engine.

A request enters only if a table row is free, the running cap allows it, and the pages
for its uncomputed tokens (plus, for a request that will decode here without computing
its prompt first, its decode reserve) fit in the free and evictable pages left after the
decode reserve of every running and reserved request. The prefill queue and a decode
worker's preallocation both admit through here.
"""

from __future__ import annotations

from baton.common.cache.manager import CacheManager
from baton.common.engine.decode import DecodeManager
from baton.common.state import Req


class Admission:
    def __init__(self, cache: CacheManager, decode: DecodeManager, max_running: int) -> None:
        self.cache = cache
        self.decode = decode
        self.max_running = max_running

    def has_room(self, scheduled: int = 0) -> bool:
        """A request could enter now (`scheduled`: admitted this step, not yet running)."""
        return (
            self.decode.num_active + scheduled < self.max_running and self.cache.table.num_free > 0
        )

    def try_admit(self, req: Req, scheduled: int = 0, with_decode_reserve: bool = False) -> bool:
        """Give `req` a table row and its cached prefix if its KV fits; False leaves it
        untouched. The caller allocates the pages (all at once, or chunk by chunk)."""
        if not self.has_room(scheduled):
            return False
        self.cache.admit(req)
        tokens = req.num_tokens - req.device_len
        if with_decode_reserve:
            tokens += self.decode.reserve_tokens_for(req)
        need = self.cache.pages_for(req, tokens)
        if need + self.decode.reserved_pages() > self.cache.available_pages():
            self.cache.release(req, cache=False)
            return False
        return True
