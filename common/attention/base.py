"""The attention-backend contract.

A step's tokens are flattened: request i contributes `extend_lens[i]` query tokens at
positions `prefix_lens[i] ..< seq_lens[i]`. A backend
  1. `prepare(batch)` once per step (plan kernels, build index tensors),
  2. `forward(q, k, v, layer, batch)` per layer: store this step's k, v into the KV pool at
     `batch.out_cache_loc` (`KVPool.write`), then `attend(q, layer, batch)`: each query to
     its request's keys `req_to_token[req_slots[i], :seq_lens[i]]` with a causal mask. A
     model that stored k, v itself (a fused kernel) calls `attend` alone.
Backends receive the KV pool and the req-to-token table, never the model runner.
Shapes: q [T, Hq, D]; k, v [T, Hk, D]; output [T, Hq, D]; Hq a multiple of Hk (GQA).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from baton.common.cache.kv_pool import KVPool

NewKV = tuple[torch.Tensor, torch.Tensor]  # this step's k and v, [T, Hk, D] each


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] KV slots written this step
    req_slots: torch.Tensor  # [B] rows of the req-to-token table
    seq_lens: torch.Tensor  # [B] tokens with KV after this step
    extend_lens: torch.Tensor  # [B] query tokens this step
    prefix_lens: torch.Tensor  # [B] tokens with KV before this step
    req_to_token: torch.Tensor  # [max_requests, max_context]
    # host copies, for backends that loop or plan on the host
    seq_lens_list: list[int]
    extend_lens_list: list[int]
    prefix_lens_list: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_list)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens_list)


class AttentionBackend(ABC):
    # set by `prepare`: this step's `attend` reads the new tokens' k and v from its `new_kv`
    # argument (where the projection left them), not from the pool
    wants_new_kv = False

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    def reads_table(self, batch: ForwardBatch) -> bool:
        """Whether this step's attention reads the req-to-token table. A step whose
        attention does not may write its table entries after its forward is queued, off
        the path to its first kernel."""
        return True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, batch.out_cache_loc, k, v)
        return self.attend(q, layer, batch, (k, v))

    @abstractmethod
    def attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        """Attention of this step's queries over the pool (this step's k, v already in it;
        also in `new_kv` [T, Hk, D] each, where the caller has them)."""

    # CUDA-graph hooks; backends that support graphs override them.
    def supports_cuda_graph(self) -> bool:
        return False

    def prepare_single_prompt(self) -> bool:
        """Attend as for a step of one prompt without a cached prefix, with kernel
        arguments that depend on the query and key lengths alone (what a prefill graph
        captures, `engine/prefill_graph.py`). False: no such mode."""
        return False


class HybridBackend(AttentionBackend):
    """Pairs a prefill backend with a decode backend; the step's shape picks one."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        super().__init__(prefill.pool, prefill.num_heads, prefill.head_dim)
        self.prefill_backend, self.decode_backend = prefill, decode
        self._active: AttentionBackend = prefill

    def _for(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode_backend if batch.is_decode else self.prefill_backend

    def prepare(self, batch: ForwardBatch) -> None:
        self._active = self._for(batch)
        self._active.prepare(batch)

    @property
    def wants_new_kv(self) -> bool:  # type: ignore[override]
        return self._active.wants_new_kv

    def reads_table(self, batch: ForwardBatch) -> bool:
        return self._for(batch).reads_table(batch)

    def attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        return self._active.attend(q, layer, batch, new_kv)

    # decode graphs are the decode backend's; a prompt's graph the prefill backend's
    def supports_cuda_graph(self) -> bool:
        return self.decode_backend.supports_cuda_graph()

    def prepare_graph(self, bs: int, batch: ForwardBatch, max_pages: int) -> None:
        self._active = self.decode_backend
        self.decode_backend.prepare_graph(bs, batch, max_pages)  # type: ignore[attr-defined]

    def prepare_single_prompt(self) -> bool:
        if not self.prefill_backend.prepare_single_prompt():
            return False
        self._active = self.prefill_backend
        return True
