"""Paged attention with Triton kernels (any page size, GQA, float32/bfloat16/float16).

`prepare()` turns the step's host lists into the few device tensors and launch sizes the
kernels need; `attend()` then launches without reading anything back from the device.
Decode steps run in CUDA graphs: `prepare_graph(bs)` gives each padded batch size its own
scratch and split count, and the kernels read the graph's fixed request buffers. The
kernels live in `triton_kernels` (decode) and `triton_extend`.

Its decode kernel is also the decode half of the flashinfer backend's default pairing
(`attention.default_decode_backend`): on an H100, at 2,048 tokens of context, it took 8.1 µs a
layer at batch 1 where flashinfer's graph-mode wrapper took 12.3, and 28.9 against 32.9
at batch 8 (`benchmarks/lab/gpu_attention.py --triton-sweep`, `results/gpu_2026-11-27_s14/`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.attention import triton_extend
from baton.common.attention import triton_kernels as kernels
from baton.common.attention.base import AttentionBackend, ForwardBatch, NewKV
from baton.common.cache.kv_pool import KVPool

# A decode split should cover at least this many keys (one key block of the partial kernel).
_MIN_KEYS_PER_SPLIT = 128
_MAX_SPLITS = 16
# Under the interpreter (`num_sms`: 16) tests exercise several splits cheaply.
_INTERPRET_MIN_KEYS_PER_SPLIT = 32


@dataclass
class _DecodePlan:
    seq_lens: torch.Tensor  # [B] int32 or int64
    part_out: torch.Tensor  # [B, Hq, S, D] float32 scratch
    part_lse: torch.Tensor  # [B, Hq, S] float32 scratch


@dataclass
class _ExtendPlan:
    q_start: torch.Tensor  # [B] int32, first query row of each request
    extend_lens: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32
    max_extend_len: int


class TritonBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, head_dim)
        if num_heads % pool.num_kv_heads:
            raise ValueError(f"{num_heads} q heads are not a multiple of {pool.num_kv_heads}")
        if pool.device.type == "cpu" and not kernels.interpreting():
            raise RuntimeError("the triton backend needs a GPU, or TRITON_INTERPRET=1 on CPU")
        self._num_sms = kernels.num_sms(pool.device)
        self._min_keys_per_split = (
            _MIN_KEYS_PER_SPLIT if pool.device.type == "cuda" else _INTERPRET_MIN_KEYS_PER_SPLIT
        )
        # decode scratch grows to the largest step seen and is reused, so its address is stable
        self._scratch = torch.empty(0, dtype=torch.float32, device=pool.device)
        self._graph_plans: dict[int, _DecodePlan] = {}  # padded batch size -> its own scratch
        self._plan: _DecodePlan | _ExtendPlan | None = None

    def num_decode_splits(self, batch_size: int, max_seq_len: int | None = None) -> int:
        """Key splits per request: the fewest (a power of two, at most 16) that give
        requests x kv heads x splits at least one program per SM, and, where the longest
        request is known, no more than leave each split a key block."""
        programs = batch_size * self.pool.num_kv_heads
        splits = -(-self._num_sms // programs)
        if max_seq_len is not None:
            splits = min(splits, -(-max_seq_len // self._min_keys_per_split))
        return min(_MAX_SPLITS, 1 << (max(1, splits) - 1).bit_length())

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            self._plan = self._prepare_decode(batch)
            return
        extend_lens = batch.extend_lens.to(torch.int32)
        self._plan = _ExtendPlan(
            q_start=torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens,
            extend_lens=extend_lens,
            prefix_lens=batch.prefix_lens.to(torch.int32),
            max_extend_len=max(batch.extend_lens_list, default=0),
        )

    def _prepare_decode(self, batch: ForwardBatch) -> _DecodePlan:
        b = batch.batch_size
        splits = self.num_decode_splits(b, max(batch.seq_lens_list, default=1))
        need = b * self.num_heads * splits * (self.head_dim + 1)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32, device=self.pool.device)
        return self._decode_plan(batch.seq_lens, self._scratch, b, splits)

    def _decode_plan(
        self, seq_lens: torch.Tensor, scratch: torch.Tensor, b: int, splits: int
    ) -> _DecodePlan:
        h, d = self.num_heads, self.head_dim
        out_size = b * h * splits * d
        return _DecodePlan(
            seq_lens=seq_lens,  # int32 or int64: the kernel reads either
            part_out=scratch[:out_size].view(b, h, splits, d),
            part_lse=scratch[out_size : out_size + b * h * splits].view(b, h, splits),
        )

    # -- CUDA graphs -------------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return self.pool.device.type == "cuda"

    def prepare_graph(self, bs: int, batch: ForwardBatch, max_pages: int) -> None:
        """The decode plan of padded batch size `bs`: its split count fixed for any
        context (the graph is captured once), its scratch its own, and the graph's
        `seq_lens` buffer read as is. Nothing to do per replay."""
        plan = self._graph_plans.get(bs)
        if plan is None:
            splits = self.num_decode_splits(bs)
            size = bs * self.num_heads * splits * (self.head_dim + 1)
            scratch = torch.empty(size, dtype=torch.float32, device=self.pool.device)
            plan = self._graph_plans[bs] = self._decode_plan(batch.seq_lens, scratch, bs, splits)
        self._plan = plan

    def attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        cache = self.pool.layer_kv(layer)
        page_size = self.pool.page_size
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan = self._plan
        if q.shape[0] == 0:
            return out
        if isinstance(plan, _DecodePlan):
            kernels.decode_attention(
                q,
                out,
                cache,
                batch.req_to_token,
                batch.req_slots,
                plan.seq_lens,
                page_size,
                self.scale,
                plan.part_out,
                plan.part_lse,
            )
        elif isinstance(plan, _ExtendPlan):
            triton_extend.extend_attention(
                q,
                out,
                cache,
                batch.req_to_token,
                batch.req_slots,
                plan.q_start,
                plan.extend_lens,
                plan.prefix_lens,
                plan.max_extend_len,
                page_size,
                self.scale,
            )
        else:
            raise RuntimeError("TritonBackend.attend called before prepare()")
        return out
