"""Triton kernel for the new tokens of prompts (extend), over the page-major KV pool.

`_extend_kernel`: one program per (q head, block of queries, request), causal, blocked over
keys; the keys strictly below the query block skip the mask. It reads the cache as the
decode kernels do (`triton_kernels`, which also holds the pieces both share) and runs under
the Triton interpreter too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.common.attention.triton_kernels import (
    LOG2E,
    LaunchConfig,
    _dot_dtype,
    _dot_precision,
    _last_dim_contiguous,
    _load_kv_block,
    _online_softmax_step,
    interpreting,
)


def extend_config(head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    # Sized on sm_90 so that nothing spills (checked with cuobjdump on AOT-compiled kernels).
    if interpreting():
        return LaunchConfig(32, 32, 4, 1)
    if dtype == torch.float32:  # IEEE fp32 dots run on FMA units and need many registers
        return LaunchConfig(32, 16, 8, 2) if head_dim > 128 else LaunchConfig(32, 32, 4, 2)
    if head_dim > 128:
        return LaunchConfig(64, 32, 8, 2)
    return LaunchConfig(128, 64, 8 if head_dim > 64 else 4, 2)


@triton.jit
def _extend_kernel(
    q_ptr, o_ptr, cache_ptr, req_to_token_ptr, req_slots_ptr,
    q_start_ptr, extend_lens_ptr, prefix_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_rt,
    stride_page, stride_kv, stride_off, stride_head,
    page_size, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    # q heads vary fastest so the GROUP programs reading one kv head run together (L2 reuse);
    # query blocks go last-first, since the last ones see the most keys
    head = tl.program_id(0)
    block = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if block * BLOCK_M >= extend_len:
        return
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    kv_head = head // GROUP

    m_idx = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m_idx < extend_len
    q_pos = prefix + m_idx
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = q_start + m_idx
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    row_ptr = req_to_token_ptr + tl.load(req_slots_ptr + b).to(tl.int64) * stride_rt

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys in [0, unmasked_end) precede every query of the block: no causal or bounds mask
    unmasked_end = ((prefix + block * BLOCK_M) // BLOCK_N) * BLOCK_N
    all_keys = tl.full([1, BLOCK_N], 1, tl.int1)
    for n0 in range(0, unmasked_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k, v = _load_kv_block(
            cache_ptr, row_ptr, n, n < unmasked_end, d, d_mask, kv_head,
            page_size, stride_page, stride_kv, stride_off, stride_head,
        )  # fmt: skip
        m, denom, acc = _online_softmax_step(q, k, v, all_keys, m, denom, acc, qk_scale, PRECISION)
    kv_end = prefix + tl.minimum((block + 1) * BLOCK_M, extend_len)
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        k, v = _load_kv_block(
            cache_ptr, row_ptr, n, n_mask, d, d_mask, kv_head,
            page_size, stride_page, stride_kv, stride_off, stride_head,
        )  # fmt: skip
        causal = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m, denom, acc = _online_softmax_step(q, k, v, causal, m, denom, acc, qk_scale, PRECISION)

    out = acc / denom[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    q_start: torch.Tensor,
    extend_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    page_size: int,
    scale: float,
) -> None:
    """Causal attention of every request's new tokens over its prefix and themselves."""
    _, num_heads, dim = q.shape
    num_kv_heads = cache.shape[3]
    batch = req_slots.shape[0]
    cfg = extend_config(dim, q.dtype)
    q = _last_dim_contiguous(q)
    grid = (num_heads, triton.cdiv(max_extend_len, cfg.block_m), batch)
    _extend_kernel[grid](
        q, out, cache, req_to_token, req_slots, q_start, extend_lens, prefix_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        page_size, scale * LOG2E,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(dim),
        PRECISION=_dot_precision(q.dtype),
        DOT_DTYPE=_dot_dtype(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
