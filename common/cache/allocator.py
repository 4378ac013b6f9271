"""Page allocator: hands out KV pages, lowest ids first.

Handing out the lowest free ids keeps one request's pages consecutive whenever the pool
is not fragmented, which makes few, large regions for the KV transfer layer.
"""

from __future__ import annotations

import heapq


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # a heap
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = 1
            heapq.heappush(self._free, p)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "a page is listed free twice"
        assert sum(self._is_free) == len(self._free), "free map and free list disagree"
        assert all(self._is_free[p] for p in self._free)
