"""Paged attention with Triton kernels (any page size, GQA, float32/bfloat16/float16).

`prepare()` turns the step's host lists into the few device tensors and launch sizes the
kernels need; `attend()` then launches without reading anything back from the device,
so a decode step can be captured in a CUDA graph. The kernels live in `triton_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.attention import triton_kernels as kernels
from baton.common.attention.base import AttentionBackend, ForwardBatch, NewKV
from baton.common.cache.kv_pool import KVPool

# A decode split should cover at least this many keys, or the reduce costs more than it saves.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16
# Under the interpreter: pretend a small device so tests exercise several splits cheaply.
_INTERPRET_SMS = 16
_INTERPRET_MIN_KEYS_PER_SPLIT = 32


@dataclass
class _DecodePlan:
    seq_lens: torch.Tensor  # [B] int32
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
        if pool.device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
            self._min_keys_per_split = _MIN_KEYS_PER_SPLIT
        else:
            self._num_sms = _INTERPRET_SMS
            self._min_keys_per_split = _INTERPRET_MIN_KEYS_PER_SPLIT
        # decode scratch grows to the largest step seen and is reused, so its address is stable
        self._scratch = torch.empty(0, dtype=torch.float32, device=pool.device)
        self._plan: _DecodePlan | _ExtendPlan | None = None

    def num_decode_splits(self, batch_size: int, max_seq_len: int) -> int:
        """Split the keys only when requests x kv heads leave the device's SMs idle."""
        programs = batch_size * self.pool.num_kv_heads
        by_occupancy = -(-2 * self._num_sms // programs)
        by_length = -(-max_seq_len // self._min_keys_per_split)
        splits = max(1, min(_MAX_SPLITS, by_occupancy, by_length))
        return 1 << (splits - 1).bit_length()  # a power of two: few kernel variants

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
        b, h, d = batch.batch_size, self.num_heads, self.head_dim
        splits = self.num_decode_splits(b, max(batch.seq_lens_list, default=1))
        need = b * h * splits * (d + 1)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32, device=self.pool.device)
        out_size = b * h * splits * d
        return _DecodePlan(
            seq_lens=batch.seq_lens.to(torch.int32),
            part_out=self._scratch[:out_size].view(b, h, splits, d),
            part_lse=self._scratch[out_size:need].view(b, h, splits),
        )

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
            kernels.extend_attention(
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
