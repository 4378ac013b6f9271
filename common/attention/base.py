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
    """Pairs a prefill backend with a decode backend; the step's shape picks one. A mixed
    step (prompt chunks, then running requests' one-token rows: `--enable-mixed-chunk`, or
    a decode worker computing a prompt beside its running requests) is split: its prompt
    rows go to the prefill backend, its decode rows to the decode backend. A prefill
    kernel given one-token rows spends a query tile on each: on an H200, flashinfer's paged
    prefill took 0.96 ms a layer for 128 decode rows of 1,460 tokens beside a chunk, the
    decode kernel 0.19 ms for the same rows alone (`benchmarks/lab/gpu_mixed_step.py`)."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        super().__init__(prefill.pool, prefill.num_heads, prefill.head_dim)
        self.prefill_backend, self.decode_backend = prefill, decode
        self._active: AttentionBackend = prefill
        self._split: _Split | None = None

    def _for(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode_backend if batch.is_decode else self.prefill_backend

    def prepare(self, batch: ForwardBatch) -> None:
        self._split = _Split.of(batch)
        if self._split is not None:
            self.prefill_backend.prepare(self._split.prompts)
            self.decode_backend.prepare(self._split.decodes)
            self._active = self.prefill_backend
            return
        self._active = self._for(batch)
        self._active.prepare(batch)

    @property
    def wants_new_kv(self) -> bool:  # type: ignore[override]
        return self._active.wants_new_kv

    def reads_table(self, batch: ForwardBatch) -> bool:
        if 0 < _prompt_rows(batch) < batch.batch_size:
            return True  # a mixed step: the decode rows read theirs
        return self._for(batch).reads_table(batch)

    def attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        split = self._split
        if split is None:
            return self._active.attend(q, layer, batch, new_kv)
        t = split.prompts.num_tokens
        head = None if new_kv is None else (new_kv[0][:t], new_kv[1][:t])
        tail = None if new_kv is None else (new_kv[0][t:], new_kv[1][t:])
        return torch.cat(
            [
                self.prefill_backend.attend(q[:t], layer, split.prompts, head),
                self.decode_backend.attend(q[t:], layer, split.decodes, tail),
            ]
        )

    # decode graphs are the decode backend's; a prompt's graph the prefill backend's
    def supports_cuda_graph(self) -> bool:
        return self.decode_backend.supports_cuda_graph()

    def prepare_graph(self, bs: int, batch: ForwardBatch, max_pages: int) -> None:
        self._active, self._split = self.decode_backend, None
        self.decode_backend.prepare_graph(bs, batch, max_pages)  # type: ignore[attr-defined]

    def prepare_single_prompt(self) -> bool:
        if not self.prefill_backend.prepare_single_prompt():
            return False
        self._active, self._split = self.prefill_backend, None
        return True


@dataclass
class _Split:
    """A mixed step as two batches: its prompt rows (first) and its trailing one-token
    rows (the running requests, scheduled after the prompt chunks)."""

    prompts: ForwardBatch
    decodes: ForwardBatch

    @staticmethod
    def of(batch: ForwardBatch) -> _Split | None:
        """None unless the step has both: prompt rows, then one-token rows."""
        first, size = _prompt_rows(batch), batch.batch_size
        if first == 0 or first == size:
            return None
        tokens = sum(batch.extend_lens_list[:first])
        return _Split(_rows(batch, 0, first, 0, tokens), _rows(batch, first, size, tokens, None))


def _prompt_rows(batch: ForwardBatch) -> int:
    """How many rows come before the step's trailing one-token rows."""
    lens = batch.extend_lens_list
    first = len(lens)
    while first > 0 and lens[first - 1] == 1:
        first -= 1
    return first


def _rows(batch: ForwardBatch, a: int, b: int | None, ta: int, tb: int | None) -> ForwardBatch:
    """Requests a..b of `batch` (tokens ta..tb) as a batch of their own."""
    return ForwardBatch(
        positions=batch.positions[ta:tb],
        out_cache_loc=batch.out_cache_loc[ta:tb],
        req_slots=batch.req_slots[a:b],
        seq_lens=batch.seq_lens[a:b],
        extend_lens=batch.extend_lens[a:b],
        prefix_lens=batch.prefix_lens[a:b],
        req_to_token=batch.req_to_token,
        seq_lens_list=batch.seq_lens_list[a:b],
        extend_lens_list=batch.extend_lens_list[a:b],
        prefix_lens_list=batch.prefix_lens_list[a:b],
    )
