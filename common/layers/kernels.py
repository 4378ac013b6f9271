"""Fused elementwise kernels (Triton) for CUDA, with torch equivalents for the CPU.

A decode step of a small batch is a long chain of tiny kernels; fusing RMSNorm with the
residual add, SiLU with the gate multiply, RoPE for q and k, and the KV-pool store cuts
that chain several-fold. Each function takes the torch path unless the tensors live on
CUDA (or `BATON_TRITON_CPU=1` asks for the Triton interpreter, for tests).
"""

from __future__ import annotations

import torch

from baton.common.env import TRITON_CPU

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional on the CPU
    HAVE_TRITON = False


TRITON_ON_CPU = TRITON_CPU.get()  # read once: this is asked on every kernel call


def use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and (x.is_cuda or TRITON_ON_CPU)


# -- RMSNorm (+ residual add) ------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
    ):
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
    )
    return out.view(shape)


# -- SiLU(gate) * up -----------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    if not use_triton(gate_up):
        gate, up = gate_up.split(n, dim=-1)
        return torch.nn.functional.silu(gate) * up
    x = gate_up.contiguous()
    rows = x.numel() // (2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out


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
        page_stride,
        kv_stride,
        page_size,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        page = slot // page_size
        off = slot % page_size
        base = page.to(tl.int64) * page_stride + off * ROW
        for start in range(0, ROW, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < ROW
            kv = tl.load(k_ptr + t * ROW + cols, mask=m)
            tl.store(buf_ptr + base + cols, kv.to(buf_ptr.dtype.element_ty), mask=m)
            vv = tl.load(v_ptr + t * ROW + cols, mask=m)
            tl.store(buf_ptr + base + kv_stride + cols, vv.to(buf_ptr.dtype.element_ty), mask=m)


def kv_store(
    layer_kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int
) -> bool:
    """Write k, v [T, Hk, D] into one layer's view [pages, 2, page_size, Hk, D] of the pool;
    False if the caller must do it."""
    if not use_triton(k) or slots.numel() == 0:
        return False
    row = k.shape[1] * k.shape[2]
    kc, vc = k.contiguous(), v.contiguous()
    _kv_store_kernel[(slots.numel(),)](
        kc,
        vc,
        layer_kv,
        slots,
        layer_kv.stride(0),
        layer_kv.stride(1),
        page_size,
        ROW=row,
        BLOCK=min(triton.next_power_of_2(row), 1024),
    )
    return True
