"""Tensor-parallel group: which rank this process is, and the collectives the layers use.

With `tp_size == 1` (the default, and every process that never calls `init_tp`) the
collectives are identities, so single-process code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


_group = TPGroup()


def tp() -> TPGroup:
    return _group


def init_tp(rank: int, size: int, init_method: str, backend: str) -> None:
    """Join the tensor-parallel group (one scheduler process per rank)."""
    global _group
    if size > 1:
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=rank, world_size=size
        )
    _group = TPGroup(rank=rank, size=size)


def leave_tp() -> None:
    """Leave the group (rank 0 after its followers stopped); this process is TP=1 again."""
    global _group
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()
