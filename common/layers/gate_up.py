"""The MLP's activation, SiLU(gate) * up: `silu_and_mul` over a gate/up projection's
output, and `gate_up_silu`, the gate/up projection with SiLU·mul in its epilogue. The
latter is one GEMM that writes the activation, where cuBLAS writes gate and up (twice the
activation's bytes) for `silu_and_mul` to read back.

Why: at 2,048 rows of Llama-8B the separate SiLU·mul moves 176 MB a layer. On an H100 this
GEMM took 628-667 µs where cuBLAS and the separate kernel took 671-694, and its output was
bit-identical (`benchmarks/lab/gpu_gate_up`, results/gpu_2026-11-27_s10/). Prompts of 2,048
tokens reached their first token in 45.2 ms instead of 47.7.

The weight is stored interleaved (`interleave`): blocks of BLOCK gate rows, each followed
by the matching BLOCK up rows, so that one TMA load brings a tile of both and one
`tl.dot` of 2 * BLOCK columns computes them (two dots of BLOCK ran at 587 TFLOP/s, one at
765). The epilogue rounds gate and up to the input dtype, as a GEMM's output would be,
then applies SiLU·mul in float32 exactly as `silu_and_mul` does. Programs are
persistent, one per SM, walking the tiles in groups of GROUP_M row blocks so that each
weight tile is reused from L2.

Hopper and later (TMA): `fits_weight` says where.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.common.layers.kernels import HALF_DTYPES, HAVE_TRITON, use_triton
from baton.common.layers.pdl import pdl

BLOCK = 128  # the interleave: gate rows per block of the weight, then as many up rows

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from baton.common.layers.pdl import pdl_start

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        HAVE_TMA = True
    except ImportError:  # pragma: no cover - Triton before 3.4
        HAVE_TMA = False

    @triton.jit
    def _gate_up_silu_kernel(
        x_desc,
        w_desc,
        out_desc,
        M,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        dtype = out_desc.dtype
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            group = tile // per_group
            first_m = group * GROUP_M
            rows = min(tiles_m - first_m, GROUP_M)
            off_m = (first_m + (tile % per_group) % rows) * BLOCK_M
            off_n = ((tile % per_group) // rows) * BLOCK_N
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([2 * off_n, k]).T, acc)
            # columns [0, BLOCK_N) of the tile are gate, [BLOCK_N, 2 BLOCK_N) up
            both = acc.to(dtype).to(tl.float32).reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1)
            g, u = both.split()
            out_desc.store([off_m, off_n], (g / (1.0 + tl.exp(-g)) * u).to(dtype))

    @triton.jit
    def _silu_mul_kernel(
        x_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr
    ):
        pdl_start(PDL)
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        if INTERLEAVE:
            gate = (cols // INTERLEAVE) * (2 * INTERLEAVE) + cols % INTERLEAVE
            up = gate + INTERLEAVE
        else:
            gate = cols
            up = n + cols
        g = tl.load(x_ptr + row * 2 * n + gate, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * n + up, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, interleaved: int = 0) -> torch.Tensor:
    """SiLU(gate) * up of a gate/up projection's output: [gate, up] along the last
    dimension, or where `interleaved` is a block size, blocks of that many gate columns
    each followed by its up columns (`interleave`'s layout)."""
    n = gate_up.shape[-1] // 2
    if not use_triton(gate_up):
        if interleaved:
            pairs = gate_up.unflatten(-1, (n // interleaved, 2, interleaved))
            gate, up = pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)
        else:
            gate, up = gate_up.split(n, dim=-1)
        return torch.nn.functional.silu(gate) * up
    x = gate_up.contiguous()
    rows = x.numel() // (2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        x, out, n, BLOCK=block, INTERLEAVE=interleaved, **pdl(x)
    )
    return out


class Config(NamedTuple):
    block_m: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# 128 x (2 x 128) tiles, 8 warps: the best of seven shapes at 2,048 and 8,192 rows on an
# H100 (results/gpu_2026-11-27_s10/call2); 4 stages rather than 3 from 256 rows (call3)
DEFAULT = Config(128, 64, 8, 8, 4)
_SMS: dict[int, int] = {}


def interleave(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[gate; up] ([2N, K]) -> blocks of `block` gate rows, each followed by its up rows."""
    n = w.shape[0] // 2
    if n % block:
        raise ValueError(f"{n} gate rows are not a multiple of {block}")
    g, u = w[:n].reshape(n // block, block, -1), w[n:].reshape(n // block, block, -1)
    return torch.stack([g, u], 1).reshape(w.shape)


def fits_weight(w: torch.Tensor) -> bool:
    """Whether a [gate; up] weight can take the fused kernel: a CUDA device of compute
    capability 9 or more, Triton with TMA, 16-bit floats, gate rows a multiple of BLOCK,
    rows 16-byte aligned."""
    if not (HAVE_TRITON and HAVE_TMA and w.is_cuda and w.dim() == 2 and w.dtype in HALF_DTYPES):
        return False
    if (w.shape[0] // 2) % BLOCK or w.shape[1] % 8:
        return False
    return torch.cuda.get_device_capability(w.device)[0] >= 9


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, config: Config = DEFAULT) -> torch.Tensor:
    """SiLU(x @ gateᵀ) * (x @ upᵀ) for an `interleave`d w of shape [2N, K]: [M, N] in x's
    dtype. The caller checked `fits_weight` (or runs the Triton interpreter)."""
    m, k = x.shape
    n = w.shape[0] // 2
    if w.shape != (2 * n, k):
        raise ValueError(f"w {tuple(w.shape)} is not [2N, {k}]")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bk = config.block_m, config.block_k
    index = (x.device.index or 0) if x.is_cuda else -1
    if index not in _SMS:
        cuda = x.is_cuda
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count if cuda else 4
    programs = min(_SMS[index], triton.cdiv(m, bm) * triton.cdiv(n, BLOCK))
    _gate_up_silu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [2 * BLOCK, bk]),
        TensorDescriptor.from_tensor(out, [bm, BLOCK]),
        m,
        n,
        k,
        BLOCK_M=bm,
        BLOCK_N=BLOCK,
        BLOCK_K=bk,
        GROUP_M=config.group_m,
        PROGRAMS=programs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
