"""The decode step's projections at small batches: y = x @ wᵀ for x [M, K] with few rows
and w [N, K], one program per block of BLOCK_N outputs and BLOCK_M rows, each reading its
rows of w once over the whole of K.

Why: at batch 1 on an H100, cuBLAS reads o_proj's weight at 2.1 TB/s and the LM head's at
2.8 TB/s, where this kernel reaches 2.4 and 3.1 (`results/gpu_2026-11-26_s07/`). Small
output blocks give every SM work even for N = 4,096. Each output is summed over K in
one program, in a fixed order, so a row's result does not depend on the batch around it.

`small_batch_linear` takes this kernel for every projection of a layer and the LM head up
to 32 rows, cuBLAS above that and off CUDA. `benchmarks/lab/gpu_linear` measures it faster than
cuBLAS alone at 1 to 16 rows on an H100; in the engine, where it launches with PDL
(`layers/pdl.py`) and cuBLAS does not, it also wins at 32 (the figures by `QKV`).

Launched with PDL, each program first asks L2 for the first PREFETCH_BYTES of each of its
weight rows, while the kernel ahead of it (a norm, RoPE, attention's reduce) still runs.
With decode attention's key prefetch (`attention/triton_kernels.py`) this made the
engine's decode steps faster on an H100 by 1% at batch 1, 2.3% at 8 and 1.3% at 32, and
by 1% at batch 8 on an H200 (results/gpu_2026-11-27_s15/).

A projection that adds to the residual stream (the MLP's down projection, `skinny_add`)
can leave the next RMSNorm to the projection that reads it (`Normed`): it adds its product
to the stream in place and writes each row's sums of squares over its block of columns;
the reader sums those into 1/rms and normalizes each tile of the stream as it loads it,
rounded as the norm kernel rounds. Only q/k/v reads a norm so, up to NORMED_ROWS rows:
that made decode steps 0.8% faster at batch 1 on an H200 (results/gpu_2026-11-27_s16/).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.common.layers.kernels import HALF_DTYPES, HAVE_TRITON, rmsnorm
from baton.common.layers.pdl import pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from baton.common.layers.pdl import pdl_start, prefetch_l2

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        parts_in_ptr,
        n_parts_in,
        norm_w_ptr,
        eps,
        parts_out_ptr,
        n_parts_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORM: tl.constexpr,
        PARTS: tl.constexpr,
        ADD: tl.constexpr,
        PREFETCH: tl.constexpr,
        LINE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if PREFETCH:  # the first PREFETCH lines of each row, while the kernel before runs
            line = tl.minimum(tl.arange(0, PREFETCH) * LINE, K - 1)
            prefetch_l2(w_ptr + tl.minimum(rn, N - 1)[:, None] * stride_wn + line[None, :])
        pdl_start(PDL)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        y_mask = (rm[:, None] < M) & (rn[None, :] < N)
        if NORM:  # x is a residual stream: each row's 1/rms from its blocks' sums of squares
            part = tl.arange(0, PARTS)
            sums = tl.load(
                parts_in_ptr + rm[:, None] * n_parts_in + part[None, :],
                mask=(rm[:, None] < M) & (part[None, :] < n_parts_in),
                other=0.0,
            )
            rstd = tl.rsqrt(tl.sum(sums, axis=1) / K + eps)
        if ADD:  # y is the residual stream, read early so that its latency hides in the loop
            residual = tl.load(y_ptrs, mask=y_mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + rk
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + cols[None, :],
                mask=(rm[:, None] < M) & (cols[None, :] < K),
                other=0.0,
            )
            if NORM:  # RMSNorm as `kernels.rmsnorm` rounds it: to x's dtype, then times g
                g = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0)
                x = (x.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty)
                x = (g.to(tl.float32)[None, :] * x.to(tl.float32)).to(x_ptr.dtype.element_ty)
            w = tl.load(
                w_ptr + rn[:, None] * stride_wn + cols[None, :],
                mask=(rn[:, None] < N) & (cols[None, :] < K),
                other=0.0,
            )
            acc += tl.dot(x, tl.trans(w))
        y = acc.to(y_ptr.dtype.element_ty)
        if ADD:  # the new stream, and its sums of squares over this block's columns
            y = (y.to(tl.float32) + residual.to(tl.float32)).to(y_ptr.dtype.element_ty)
            yf = tl.where(y_mask, y.to(tl.float32), 0.0)
            tl.store(
                parts_out_ptr + rm * n_parts_out + tl.program_id(0),
                tl.sum(yf * yf, axis=1),
                mask=rm < M,
            )
        tl.store(y_ptrs, y, mask=y_mask)


# What each program asks L2 for before the kernel ahead of it has finished: the first
# PREFETCH_BYTES of each of its weight rows (`pdl.prefetch_l2`).
PREFETCH_BYTES = 1024


class Normed(NamedTuple):
    """RMSNorm of a residual stream's rows, not yet applied. The projection that reads it
    applies it as it loads its input (`small_batch_linear`), so the norm runs no kernel of
    its own; `parts` holds each row's sums of squares over blocks of its columns, written by
    the projection that added to the stream (`small_batch_add_norm`)."""

    stream: torch.Tensor  # [M, K], the residual stream
    parts: torch.Tensor  # [M, P] float32
    weight: torch.Tensor  # the norm's gain [K]
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.stream.shape

    def applied(self) -> torch.Tensor:
        """The norm as a tensor, for a projection that cannot apply it itself."""
        return rmsnorm(self.stream, self.weight, self.eps)


def skinny_linear(
    x: torch.Tensor | Normed,
    w: torch.Tensor,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ -> [M, N] in x's dtype (float32 accumulation); of the norm
    applied where x is `Normed`."""
    y, _ = _launch(x, w, (block_n, block_k, num_warps, num_stages))
    return y


def skinny_add(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """residual += x @ wᵀ in place, rounded as `kernels.rmsnorm` adds (the product to the
    residual's dtype first); returns the new rows' sums of squares over each block of
    block_n columns, [M, cdiv(N, block_n)] in float32, for `Normed.parts`."""
    _, parts = _launch(x, w, (block_n, block_k, num_warps, num_stages), residual)
    assert parts is not None
    return parts


def _launch(
    x: torch.Tensor | Normed,
    w: torch.Tensor,
    blocks: tuple[int, int, int, int],
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    block_n, block_k, num_warps, num_stages = blocks
    normed = None
    if isinstance(x, Normed):
        normed, x = x, x.stream
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has {k} columns, w {w.shape[1]}")
    x = x.contiguous()
    w = w.contiguous()
    # every row of x in one block, so w is read once (16: tl.dot's smallest tile; the rows
    # past M are masked)
    block_m = max(16, triton.next_power_of_2(m)) if m <= 64 else 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    parts_out = None
    if residual is None:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        if residual.shape != (m, n) or not residual.is_contiguous():
            raise ValueError(f"the residual must be contiguous [{m}, {n}]")
        y = residual
        parts_out = torch.empty(m, grid[0], dtype=torch.float32, device=x.device)
    parts_in = normed.parts.contiguous() if normed is not None else y  # y: never read
    launch = pdl(x)
    line = 128 // w.element_size()  # elements of a 128-byte line
    # lines of each row, only where the kernel starts before the one ahead ends, and that one
    # is small: a Normed input comes straight from another projection
    prefetch = 0
    if launch["PDL"] and normed is None:
        prefetch = triton.next_power_of_2(
            triton.cdiv(min(PREFETCH_BYTES, k * w.element_size()), 128)
        )
    _skinny_kernel[grid](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        parts_in,
        parts_in.shape[1],
        normed.weight if normed is not None else w,
        normed.eps if normed is not None else 0.0,
        parts_out if parts_out is not None else y,
        grid[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM=normed is not None,
        PARTS=triton.next_power_of_2(parts_in.shape[1]),
        ADD=residual is not None,
        PREFETCH=prefetch,
        LINE=line,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
    )
    return y, parts_out


class Skinny(NamedTuple):
    """When and how a layer takes `skinny_linear`: up to `max_rows` rows of input."""

    max_rows: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


Tiers = tuple[Skinny, ...]  # by max_rows, smallest first: the first that holds the rows


class Projection:
    """Where one projection takes the kernel: `tiers` as tuned on an H100 (and anywhere
    else), `by_device` where another GPU was measured to want others, by a word of its
    name as CUDA reports it; up to `normed_rows` rows it applies a `Normed` input's norm
    itself."""

    def __init__(
        self,
        tiers: Tiers,
        by_device: tuple[tuple[str, Tiers], ...] = (),
        normed_rows: int = 0,
    ) -> None:
        self.tiers = tiers
        self.by_device = by_device
        self.normed_rows = normed_rows
        every = [*tiers, *(how for _, other in by_device for how in other)]
        self.max_rows = max(how.max_rows for how in every)  # beyond it: F.linear anywhere
        self._on: dict[torch.device, Tiers] = {}

    def on(self, device: torch.device) -> Tiers:
        tiers = self._on.get(device)
        if tiers is None:
            name = device_name(device)
            tiers = next((t for word, t in self.by_device if word in name), self.tiers)
            self._on[device] = tiers
        return tiers


@functools.cache
def device_name(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_name(index)


# Where each projection of the Llama family takes the kernel, and its block shapes.
# - µs per call in gpu_linear on an H100, kernel/cuBLAS, weights read from HBM inside CUDA
#   graphs (results/gpu_2026-11-26_s07/ and gpu_2026-11-27_s09/call4): o_proj 14.2/16.0,
#   14.7/16.1 at 1 and 8 rows; down 42.4/44.2, 42.6/44.6; qkv 19.9/20.5, 20.4/21.3,
#   20.3/21.5 at 1, 8 and 16 rows; gate_up 80.0/81.7, 82.3/82.7, 82.0/83.1; the LM head
#   (vocabulary 128,256) 338/370, 344/373, and 359/385 at 32 rows.
# - At 32 rows gpu_linear has o_proj, gate_up and down slower than cuBLAS by 0.5-2.4 µs,
#   yet in the engine, where the kernel launches with PDL and cuBLAS does not, the decode
#   step at batch 32 took 9.26 ms with all four on the kernel up to 32 rows against 9.63
#   with cuBLAS above 8 and 16 rows (results/gpu_2026-11-27_s09/call7).
# - An H200 (HBM3e) reads gate_up's weight faster in smaller blocks at one row, 56.9 µs
#   with 32x256 and 3 stages against 58.8, and the LM head's in 233.7 with 32x256 against
#   237.8 (gpu_linear, results/gpu_2026-11-27_s15/call4). In the engine the decode step at
#   batch 1 took 4.51 ms against 4.54-4.56 (call5). At 32 rows gpu_linear had gate_up
#   4.4 µs and the LM head 15 µs faster with 128x128 blocks, yet the engine's step at batch
#   32 was 6.79-6.80 ms either way, so from 2 rows the H200 keeps the H100's tiers.
# - Up to NORMED_ROWS rows the q/k/v projection applies the layer's input norm itself
#   (`Normed`), so no norm kernel runs between the down projection before it and it. Each
#   program redoes the norm's 1/rms from the sums the down projection wrote, and gate/up and
#   the LM head have too many programs for that to pay: on an H200 it cost qkv 0.2 µs a
#   call at 1 row (96 programs) and 3.6 µs at 32, gate/up 6.2 µs at 1 row (896 programs),
#   the LM head 15 µs (4,008 programs), against 2.3 µs for the norm kernel it replaces
#   (results/gpu_2026-11-27_s16/).
NORMED_ROWS = 16
QKV = Projection((Skinny(32, 64, 256, 4, 4),), normed_rows=NORMED_ROWS)
O_PROJ = Projection((Skinny(32, 32, 512, 4, 3),))
_GATE_UP = (Skinny(16, 64, 256, 4, 4), Skinny(32, 128, 128, 8, 3))
GATE_UP = Projection(_GATE_UP, (("H200", (Skinny(1, 32, 256, 4, 3), *_GATE_UP)),))
DOWN = Projection((Skinny(32, 32, 512, 4, 3),))
_LM_HEAD = (Skinny(32, 64, 256, 4, 4),)
LM_HEAD = Projection(_LM_HEAD, (("H200", (Skinny(1, 32, 256, 4, 4), *_LM_HEAD)),))


def _tier(x: torch.Tensor, projection: Projection) -> Skinny | None:
    """The first of the projection's tiers on x's device that holds x's rows, for a 2-D
    CUDA input in 16-bit floats where Triton is present; None: `F.linear`."""
    rows = x.shape[0]
    if (
        rows <= projection.max_rows
        and HAVE_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in HALF_DTYPES
    ):
        for how in projection.on(x.device):
            if rows <= how.max_rows:
                return how
    return None


def small_batch_linear(
    x: torch.Tensor | Normed, w: torch.Tensor, projection: Projection
) -> torch.Tensor:
    """x @ wᵀ: `skinny_linear` where the projection has a tier for x, `F.linear` (of the
    norm applied, where x is `Normed`) otherwise."""
    how = _tier(x.stream if isinstance(x, Normed) else x, projection)
    if how is not None:
        return skinny_linear(x, w, *how[1:])
    return F.linear(x.applied() if isinstance(x, Normed) else x, w)


def small_batch_add_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    projection: Projection,
    residual: torch.Tensor,
    norm: tuple[torch.Tensor, float],
) -> Normed | None:
    """RMSNorm (gain and eps `norm`) of x @ wᵀ + residual, left for the projection that
    reads it, with `residual` updated in place to that sum, where the projection has a tier
    for x: so the norm runs no kernel of its own. None, and nothing done, otherwise."""
    how = _tier(x, projection)
    if how is None or not residual.is_contiguous():
        return None
    parts = skinny_add(x, w, residual, *how[1:])
    return Normed(residual, parts, *norm)
