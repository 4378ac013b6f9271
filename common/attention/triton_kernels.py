"""Triton kernels for paged attention over the page-major KV pool.

One layer's cache is read through the strided view `pool.layer_kv(layer)`:

    cache[page, k|v, offset_in_page, kv_head, head_dim]      KV slot s = page * page_size + offset

and a request's keys are found through its row of the req-to-token table. Page size is a
runtime integer for the extend kernel and a compile-time one for decode (any value >= 1,
no power-of-two assumption; the engine uses one per process); head_dim is padded to a power
of two with masks. Scores, softmax statistics and accumulators are float32 whatever the
cache dtype; softmax runs in base 2 (`exp2`) with the scale folded into `qk_scale`.

Kernels:
  * `_decode_partial_kernel` + `_decode_reduce_kernel`: flash-decoding. A program takes one
    (request, kv head, split of the keys) and all the q heads sharing that kv head, so each
    K/V block is read once per group; the reduce merges splits by their log-sum-exp. With
    one split (enough requests to fill the device) the partial kernel writes the output.
    Launched with PDL, each program first asks L2 for its split's first key block, while
    the kernel ahead of it still runs.
  * the extend kernel (prompts' new tokens) lives in `triton_extend`, and takes the pieces
    it shares with decode from here: the launch config, the K/V gather and the online
    softmax step.

All kernels also run under the Triton interpreter (`TRITON_INTERPRET=1`), which is how CI
checks them without a GPU; block sizes shrink there to keep the interpreter quick.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton.common.layers.pdl import pdl, pdl_start, prefetch_l2

LOG2E = 1.4426950408889634
# Decode asks L2 for each split's first key block while the kernel ahead of it (RoPE and the
# KV store) still runs (`pdl.prefetch_l2`); with the projections' weight prefetch
# (`layers/skinny.py`) it made decode steps 1-2% faster on an H100 at batches 1 to 32.
PREFETCH_KV = True


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (CPU tensors, numpy semantics)."""
    return bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and warps for one kernel; `num_warps`/`num_stages` are ignored when interpreting."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, dtype: torch.dtype, waves: float = 1.0) -> LaunchConfig:
    """The partial kernel's launch; `waves`: its programs per SM of the device.

    block_m is the number of q-head rows per program: tl.dot needs at least 16 on GPUs. At
    up to two programs per SM, key blocks of 128 and two stages were fastest on an H100
    (8.1 µs a layer at batch 1, 93.1 at batch 32, 2,048 keys); with more programs, blocks
    of 64 and four stages (185.7 µs at batch 64) (`gpu_attention --triton-sweep`)."""
    if interpreting():
        return LaunchConfig(16, 32, 4, 1)
    if dtype == torch.float32:
        return LaunchConfig(16, 16 if head_dim > 128 else 32, 8, 2)
    block = 128 if waves <= 2 else 64
    return LaunchConfig(16, block if head_dim <= 128 else block // 2, 4, 2 if waves <= 2 else 4)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (16 for anything else: the interpreter)."""
    if device.type != "cuda":
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 pools must match the torch reference: no TF32 truncation on tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    # The interpreter (triton 3.9) multiplies bfloat16 operands as their raw uint16 bits.
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


# -- shared pieces -------------------------------------------------------------------------


@triton.jit
def _load_kv_block(
    cache_ptr, row_ptr, n, n_mask, d, d_mask, kv_head,
    page_size, stride_page, stride_kv, stride_off, stride_head,
):  # fmt: skip
    """Gather keys/values at positions `n` of one request: [BLOCK_N, BLOCK_D] each."""
    slot = tl.load(row_ptr + n, mask=n_mask, other=0).to(tl.int64)
    base = (slot // page_size) * stride_page + (slot % page_size) * stride_off
    ptrs = cache_ptr + (base + kv_head * stride_head)[:, None] + d[None, :]
    mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(ptrs, mask=mask, other=0.0)
    v = tl.load(ptrs + stride_kv, mask=mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, s_mask, m, denom, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one key block into the running max `m`, denominator `denom` and output `acc` (log2).
    `q` is already in the dot operand dtype; k, v and the probabilities are cast to it."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, denom, acc


# -- decode ------------------------------------------------------------------------------


@triton.jit
def _split_keys(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split: whole key blocks, so trailing splits of a short request may be
    empty."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _prefetch_kv_block(
    cache_ptr, req_to_token_ptr, req_slots_ptr, seq_lens_ptr, b, kv_head, split, num_splits,
    stride_rt, max_context, num_pages, stride_page, stride_kv, stride_off, stride_head,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    LINES: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    """Ask L2 for the keys and values of a split's first block, before the kernel ahead has
    finished. Lengths and slots are read past L1 (.cg), so that the reads after the wait
    see what that kernel wrote, and clamped: values from before it only aim a hint."""
    seq_len = tl.load(seq_lens_ptr + b, cache_modifier=".cg").to(tl.int32)
    chunk = _split_keys(seq_len, num_splits, BLOCK_N)
    n = tl.minimum(split * chunk + tl.arange(0, BLOCK_N), tl.minimum(seq_len, max_context) - 1)
    n = tl.maximum(n, 0)
    slot_row = tl.load(req_slots_ptr + b, cache_modifier=".cg").to(tl.int64)
    slot = tl.load(req_to_token_ptr + slot_row * stride_rt + n, cache_modifier=".cg").to(tl.int64)
    page = tl.minimum(tl.maximum(slot // PAGE_SIZE, 0), num_pages - 1)
    base = page * stride_page + (slot % PAGE_SIZE) * stride_off + kv_head * stride_head
    lines = tl.minimum(tl.arange(0, LINES) * LINE, HEAD_DIM - 1)  # a head's 128-byte lines
    ptrs = cache_ptr + base[:, None] + lines[None, :]
    prefetch_l2(ptrs)
    prefetch_l2(ptrs + stride_kv)


@triton.jit
def _decode_partial_kernel(
    q_ptr, cache_ptr, req_to_token_ptr, req_slots_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    o_ptr, stride_ot, stride_oh, stride_qt, stride_qh, stride_rt, max_context, num_pages,
    stride_page, stride_kv, stride_off, stride_head,
    num_q_heads, num_splits, qk_scale, PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (request, kv head, split of the keys). Without SPLIT (one split) it writes the
    output itself, and no reduce runs."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PREFETCH:
        _prefetch_kv_block(
            cache_ptr, req_to_token_ptr, req_slots_ptr, seq_lens_ptr, b, kv_head, split,
            num_splits, stride_rt, max_context, num_pages, stride_page, stride_kv, stride_off,
            stride_head, PAGE_SIZE, HEAD_DIM, BLOCK_N, LINES, LINE,
        )  # fmt: skip
    pdl_start(PDL)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    chunk = _split_keys(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    h_mask = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    row_ptr = req_to_token_ptr + tl.load(req_slots_ptr + b).to(tl.int64) * stride_rt

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k, v = _load_kv_block(
            cache_ptr, row_ptr, n, n_mask, d, d_mask, kv_head,
            PAGE_SIZE, stride_page, stride_kv, stride_off, stride_head,
        )  # fmt: skip
        m, denom, acc = _online_softmax_step(
            q, k, v, n_mask[None, :], m, denom, acc, qk_scale, PRECISION
        )

    # an empty split reports lse = -inf and a zero output, so the reduce weighs it 0
    nonempty = denom > 0
    out = acc / tl.where(nonempty, denom, 1.0)[:, None]
    if not SPLIT:
        tl.store(
            o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )
        return
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, denom, 1.0)), float("-inf"))
    part = (b * num_q_heads + heads) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=h_mask)
    tl.store(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, o_ptr,
    stride_ot, stride_oh, num_q_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    part = (b * num_q_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    weight = weight / tl.sum(weight, 0)
    vals = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(vals * weight[:, None], 0)
    tl.store(
        o_ptr + b * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_mask
    )


# -- launchers ---------------------------------------------------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    config: LaunchConfig | None = None,
) -> None:
    """One query per request. `part_out` [B, Hq, S, D] and `part_lse` [B, Hq, S] are float32
    scratch (contiguous); S, the number of key splits, is their third dimension. `config`:
    the partial kernel's launch (`decode_config` by default)."""
    batch, num_heads, dim = q.shape
    num_kv_heads = cache.shape[3]
    num_splits = part_lse.shape[2]
    waves = batch * num_kv_heads * num_splits / num_sms(q.device)
    cfg = config or decode_config(dim, q.dtype, waves)
    q = _last_dim_contiguous(q)
    block_d = triton.next_power_of_2(dim)
    launch = pdl(q)
    line = 128 // cache.element_size()  # elements of a 128-byte line
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q, cache, req_to_token, req_slots, seq_lens, part_out, part_lse,
        out, out.stride(0), out.stride(1), q.stride(0), q.stride(1), req_to_token.stride(0),
        req_to_token.shape[1], cache.shape[0],
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        num_heads, num_splits, scale * LOG2E, PAGE_SIZE=page_size,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=dim,
        BLOCK_H=max(cfg.block_m, triton.next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_D=block_d, BLOCK_N=cfg.block_n, PRECISION=_dot_precision(q.dtype),
        DOT_DTYPE=_dot_dtype(q.dtype), SPLIT=num_splits > 1,
        PREFETCH=launch["PDL"] and PREFETCH_KV, LINES=triton.next_power_of_2(triton.cdiv(dim, line)),
        LINE=line,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )  # fmt: skip
    if num_splits == 1:
        return
    _decode_reduce_kernel[(batch, num_heads)](
        part_out, part_lse, out,
        out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        num_warps=1 if dim <= 64 else 2, **pdl(q),
    )  # fmt: skip
