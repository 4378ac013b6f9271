"""Greedy sampling's argmax over the vocabulary, in two small Triton kernels on CUDA (torch's
`argmax` elsewhere); importable without Triton, as `kernels` is."""

from __future__ import annotations

import torch

from baton.common.layers.kernels import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _argmax_part_kernel(x_ptr, val_ptr, idx_ptr, n, stride, parts, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=-float("inf"))
        best, at = tl.max(
            x.to(tl.float32), axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        tl.store(val_ptr + row * parts + part, best)
        tl.store(idx_ptr + row * parts + part, part * BLOCK + at)

    @triton.jit
    def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, parts, PARTS: tl.constexpr):
        row = tl.program_id(0)
        p = tl.arange(0, PARTS)
        vals = tl.load(val_ptr + row * parts + p, mask=p < parts, other=-float("inf"))
        idx = tl.load(idx_ptr + row * parts + p, mask=p < parts, other=0)
        best = tl.max(vals, axis=0)
        # the first index of the maximum, as torch.argmax: the lowest among the parts' firsts
        first = tl.min(tl.where(vals == best, idx, 2147483647), axis=0)
        tl.store(out_ptr + row, first.to(tl.int64))


_ARGMAX_BLOCK = 4096


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` of [B, V] (the first index of each row's maximum, as torch), in
    two small kernels on CUDA: torch's one-row reduction takes 28 µs over a 128,256-token
    vocabulary on an H100 (`results/gpu_2026-11-26_s07/call5`), since it spreads a row over
    few blocks. Rows with NaN: the index of a finite maximum, where torch gives the NaN's."""
    if not use_triton(logits) or logits.dim() != 2 or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    parts = triton.cdiv(n, _ARGMAX_BLOCK)
    vals = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    _argmax_part_kernel[(rows, parts)](
        logits, vals, idx, n, logits.stride(0), parts, BLOCK=_ARGMAX_BLOCK
    )
    _argmax_final_kernel[(rows,)](vals, idx, out, parts, PARTS=triton.next_power_of_2(parts))
    return out
