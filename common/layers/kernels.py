"""Fused elementwise kernels (Triton) for CUDA, with torch equivalents for the CPU.

A decode step of a small batch is a long chain of tiny kernels; fusing RMSNorm with the
residual add, and everything between the q/k/v projection and attention (q/k norms, RoPE,
the KV-pool store), cuts that chain several-fold. Each function takes the torch path
unless the tensors live on CUDA (or `BATON_TRITON_CPU=1` asks for the Triton interpreter,
for tests).
"""

from __future__ import annotations

import torch

from baton.common.env import TRITON_CPU
from baton.common.layers.pdl import pdl

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional on the CPU
    HAVE_TRITON = False


TRITON_ON_CPU = TRITON_CPU.get()  # read once: this is asked on every kernel call
HALF_DTYPES = (torch.bfloat16, torch.float16)  # the 16-bit floats the projection kernels take


def use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and (x.is_cuda or TRITON_ON_CPU)


# -- RMSNorm (+ residual add) ------------------------------------------------------------
if HAVE_TRITON:
    from baton.common.layers.pdl import pdl_start

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        n_cols,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)  # the new residual
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(
            out_ptr + row * n_cols + cols,
            (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
            mask=mask,
        )


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm(x [+ residual]); with `residual`, it is updated in place to x + residual."""
    if not use_triton(x):
        if residual is not None:
            x = x + residual
            residual.copy_(x)
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * y
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    res = residual.view(-1, shape[-1]) if residual is not None else x2
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        res,
        weight,
        out,
        shape[-1],
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(shape[-1]),
        **pdl(x2),
    )
    return out.view(shape)


# -- rotary (rotate-half), q and k in place ------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _rope_kernel(
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_stride,
        k_stride,
        hq,
        hk,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0)
        pos = tl.load(pos_ptr + t)
        d = tl.arange(0, HALF)
        cos = tl.load(cos_ptr + pos * HALF + d)
        sin = tl.load(sin_ptr + pos * HALF + d)
        heads = tl.arange(0, BLOCK_H)
        for base in range(0, hq + hk, BLOCK_H):
            h = base + heads
            is_q = h < hq
            valid = h < hq + hk
            off_q = t * q_stride + h[:, None] * (2 * HALF) + d[None, :]
            off_k = t * k_stride + (h[:, None] - hq) * (2 * HALF) + d[None, :]
            mq = (is_q & valid)[:, None]
            mk = ((~is_q) & valid)[:, None]
            x1 = tl.where(
                mq,
                tl.load(q_ptr + off_q, mask=mq, other=0.0),
                tl.load(k_ptr + off_k, mask=mk, other=0.0),
            ).to(tl.float32)
            x2 = tl.where(
                mq,
                tl.load(q_ptr + off_q + HALF, mask=mq, other=0.0),
                tl.load(k_ptr + off_k + HALF, mask=mk, other=0.0),
            ).to(tl.float32)
            o1 = x1 * cos[None, :] - x2 * sin[None, :]
            o2 = x2 * cos[None, :] + x1 * sin[None, :]
            tl.store(q_ptr + off_q, o1.to(q_ptr.dtype.element_ty), mask=mq)
            tl.store(q_ptr + off_q + HALF, o2.to(q_ptr.dtype.element_ty), mask=mq)
            tl.store(k_ptr + off_k, o1.to(k_ptr.dtype.element_ty), mask=mk)
            tl.store(k_ptr + off_k + HALF, o2.to(k_ptr.dtype.element_ty), mask=mk)


def rope_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> bool:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place; False if the caller must do it."""
    d = q.shape[-1]
    if not use_triton(q) or any(x.stride(-1) != 1 or x.stride(-2) != d for x in (q, k)):
        return False
    half = q.shape[-1] // 2
    if half & (half - 1):
        return False
    t, hq, hk = q.shape[0], q.shape[1], k.shape[1]
    _rope_kernel[(t,)](
        q,
        k,
        cos,
        sin,
        positions,
        q.stride(0),
        k.stride(0),
        hq,
        hk,
        HALF=half,
        BLOCK_H=min(triton.next_power_of_2(hq + hk), 16),
    )
    return True


# -- KV-pool store -------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _kv_store_kernel(
        k_ptr,
        v_ptr,
        buf_ptr,
        slot_ptr,
        k_stride,
        v_stride,
        page_stride,
        kv_stride,
        page_size,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        page = slot // page_size
        off = slot % page_size
        base = page * page_stride + off * ROW
        for start in range(0, ROW, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < ROW
            kv = tl.load(k_ptr + t * k_stride + cols, mask=m)
            tl.store(buf_ptr + base + cols, kv.to(buf_ptr.dtype.element_ty), mask=m)
            vv = tl.load(v_ptr + t * v_stride + cols, mask=m)
            tl.store(buf_ptr + base + kv_stride + cols, vv.to(buf_ptr.dtype.element_ty), mask=m)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] whose rows of H * D elements are contiguous (views of a fused projection
    qualify), or a contiguous copy."""
    d = x.shape[-1]
    return x if x.stride(-1) == 1 and x.stride(-2) == d else x.contiguous()


def kv_store(
    layer_kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int
) -> bool:
    """Write k, v [T, Hk, D] into one layer's view [pages, 2, page_size, Hk, D] of the pool;
    False if the caller must do it."""
    if not use_triton(k) or slots.numel() == 0:
        return False
    row = k.shape[1] * k.shape[2]
    kc, vc = _token_rows(k), _token_rows(v)
    _kv_store_kernel[(slots.numel(),)](
        kc,
        vc,
        layer_kv,
        slots,
        kc.stride(0),
        vc.stride(0),
        layer_kv.stride(0),
        layer_kv.stride(1),
        page_size,
        ROW=row,
        BLOCK=min(triton.next_power_of_2(row), 1024),
    )
    return True


# -- one layer's q/k/v: (q/k RMSNorm), RoPE, k and v into the pool, in one pass ----------------
if HAVE_TRITON:

    @triton.jit
    def _normed(x1, x2, is_q, q_w_ptr, k_w_ptr, d, eps, HALF: tl.constexpr):
        """RMSNorm of each head's 2 * HALF values with the q or the k weight, rounded where
        the unfused path rounds."""
        dtype = q_w_ptr.dtype.element_ty
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.where(is_q, tl.load(q_w_ptr + d)[None, :], tl.load(k_w_ptr + d)[None, :])
        w2 = tl.where(
            is_q, tl.load(q_w_ptr + HALF + d)[None, :], tl.load(k_w_ptr + HALF + d)[None, :]
        )
        y1 = (w1.to(tl.float32) * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y2 = (w2.to(tl.float32) * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        return y1, y2

    @triton.jit
    def _qkv_rope_store_kernel(
        qkv_ptr,
        q_ptr,
        buf_ptr,
        slot_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_norm_ptr,
        k_norm_ptr,
        qkv_stride,
        page_stride,
        kv_stride,
        page_size,
        hq,
        hk,
        eps,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_NORM: tl.constexpr,
        KEEP_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        row = qkv_ptr + t * qkv_stride
        pos = tl.load(pos_ptr + t)
        d = tl.arange(0, HALF)
        cos = tl.load(cos_ptr + pos * HALF + d)[None, :]
        sin = tl.load(sin_ptr + pos * HALF + d)[None, :]
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv_base = (slot // page_size) * page_stride + (slot % page_size) * hk * 2 * HALF
        heads = tl.arange(0, BLOCK_H)
        for start in range(0, hq + hk, BLOCK_H):  # q heads, then k heads
            h = start + heads
            is_q = (h < hq)[:, None]
            is_k = ((h >= hq) & (h < hq + hk))[:, None]
            col = h[:, None] * (2 * HALF) + d[None, :]
            x1 = tl.load(row + col, mask=is_q | is_k, other=0.0).to(tl.float32)
            x2 = tl.load(row + col + HALF, mask=is_q | is_k, other=0.0).to(tl.float32)
            if HAS_NORM:
                x1, x2 = _normed(x1, x2, is_q, q_norm_ptr, k_norm_ptr, d, eps, HALF)
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            q_at = q_ptr + t * hq * 2 * HALF + col
            tl.store(q_at, o1.to(q_ptr.dtype.element_ty), mask=is_q)
            tl.store(q_at + HALF, o2.to(q_ptr.dtype.element_ty), mask=is_q)
            k_at = buf_ptr + kv_base + col - hq * 2 * HALF
            # rounded to the activations' dtype first, as the unfused path stores them
            tl.store(k_at, o1.to(q_ptr.dtype.element_ty).to(buf_ptr.dtype.element_ty), mask=is_k)
            k2_out = o2.to(q_ptr.dtype.element_ty).to(buf_ptr.dtype.element_ty)
            tl.store(k_at + HALF, k2_out, mask=is_k)
            if KEEP_K:  # the rotated k back into its row, for attention to read it there
                tl.store(row + col, o1.to(q_ptr.dtype.element_ty), mask=is_k)
                tl.store(row + col + HALF, o2.to(q_ptr.dtype.element_ty), mask=is_k)
        for start in range(0, hk, BLOCK_H):  # v heads, unchanged
            h = start + heads
            m = (h < hk)[:, None]
            col = h[:, None] * (2 * HALF) + d[None, :]
            v_at = buf_ptr + kv_base + kv_stride + col
            src = row + (hq + hk) * 2 * HALF + col
            v1 = tl.load(src, mask=m, other=0.0)
            v2 = tl.load(src + HALF, mask=m, other=0.0)
            tl.store(v_at, v1.to(buf_ptr.dtype.element_ty), mask=m)
            tl.store(v_at + HALF, v2.to(buf_ptr.dtype.element_ty), mask=m)


def qkv_rope_store(
    qkv: torch.Tensor,
    heads: tuple[int, int],
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    layer_kv: torch.Tensor,
    slots: torch.Tensor,
    keep_k: bool = False,
) -> torch.Tensor | None:
    """One kernel for what follows a layer's fused q/k/v projection `qkv` [T, (Hq + 2 Hk) D]:
    q and k RMSNorm per head (`qk_norm`: q weight, k weight, eps; Qwen3), rotary embedding
    (`cos_sin` [max_position, D / 2] each) of q and k, and k, v written into one layer's
    view [pages, 2, page_size, Hk, D] of the KV pool at `slots` [T]. Returns q [T, Hq, D]
    (contiguous), or None where the caller must take the unfused path (no Triton here, or a
    head_dim that is not a power of two). `keep_k`: also leave the normed, rotated k in
    `qkv`'s k columns (a ragged prefill attends to it there)."""
    hq, hk = heads
    dim = layer_kv.shape[-1]
    half = dim // 2
    if not use_triton(qkv) or qkv.stride(-1) != 1 or half & (half - 1) or slots.numel() == 0:
        return None
    t = qkv.shape[0]
    q = torch.empty(t, hq, dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos_sin
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # unread
    _qkv_rope_store_kernel[(t,)](
        qkv,
        q,
        layer_kv,
        slots,
        positions,
        cos,
        sin,
        q_norm,
        k_norm,
        qkv.stride(0),
        layer_kv.stride(0),
        layer_kv.stride(1),
        layer_kv.shape[2],
        hq,
        hk,
        eps,
        HALF=half,
        BLOCK_H=min(triton.next_power_of_2(hq + hk), 16),
        HAS_NORM=qk_norm is not None,
        KEEP_K=keep_k,
        **pdl(qkv),
    )
    return q
