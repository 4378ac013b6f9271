"""Full-head KV pages for the KV transfer layer under tensor parallelism.

Each rank's pool holds its shard of the KV heads; the transfer layer moves whole pages.
Rank 0 of a prefill or decode worker keeps a *wire* buffer of full-head pages: after the
step that completes pages, the ranks' shards are gathered into it (prefill); before a
received request decodes, its pages are scattered from it to the ranks (decode). Both are
collectives: every rank calls them with the same pages; only rank 0 holds the buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from baton.common.distributed import tp

if TYPE_CHECKING:
    from baton.common.cache.kv_pool import KVPool


class KVWire:
    def __init__(self, pool: KVPool, num_kv_heads: int, holder: bool) -> None:
        self.pool = pool
        self.buffer: torch.Tensor | None = None
        if holder:
            shape = list(pool.buffer.shape)
            shape[4] = num_kv_heads
            self.buffer = torch.zeros(shape, dtype=pool.dtype, device=pool.device)

    def gather(self, pages: list[int]) -> None:
        """The ranks' shards of `pages` -> rank 0's buffer."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
        local = self.pool.buffer.index_select(0, idx).contiguous()
        g = tp()
        parts = [torch.empty_like(local) for _ in range(g.size)] if g.rank == 0 else None
        dist.gather(local, parts, dst=0)
        if self.buffer is not None and parts is not None:
            self.buffer.index_copy_(0, idx, torch.cat(parts, dim=4))

    def scatter(self, pages: list[int]) -> None:
        """Rank 0's buffer -> the ranks' shards of `pages`."""
        pool = self.pool
        idx = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        local = torch.empty(
            (len(pages), *pool.buffer.shape[1:]), dtype=pool.dtype, device=pool.device
        )
        parts = None
        if self.buffer is not None:
            parts = [
                p.contiguous() for p in self.buffer.index_select(0, idx).chunk(tp().size, dim=4)
            ]
        dist.scatter(local, parts, src=0)
        pool.buffer.index_copy_(0, idx, local)
