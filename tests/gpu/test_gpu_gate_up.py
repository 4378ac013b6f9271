"""The fused gate/up GEMM on the GPU (Hopper): the MLP interleaves its weight after
loading and then agrees with the separate projection and SiLU·mul at every batch size,
on the fused kernel from FUSED_MIN_ROWS rows, on the small-batch kernel or cuBLAS and the
interleaved SiLU·mul below."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from baton.common.layers import gate_up
from baton.common.layers.norm import RMSNorm
from baton.common.models import llama
from tests.conftest import llama_8b_config

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the fused kernel needs TMA (Hopper or later)",
)


@pytest.mark.parametrize("rows", [33, 300, 2048])
def test_fused_kernel_matches_cublas_then_silu_mul(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(2 * 1408, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    want = gate_up.silu_and_mul(F.linear(x, w))
    got = gate_up.gate_up_silu(x, gate_up.interleave(w))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got == want).float().mean() > 0.99  # the same rounding, but a summation order


@pytest.mark.parametrize("rows", [1, 32, 33, 300, 1024, 1500])
def test_mlp_after_load_agrees_with_the_plain_layout(rows: int) -> None:
    torch.set_default_dtype(torch.bfloat16)
    try:
        cfg = llama_8b_config(num_layers=1, vocab_size=1000, intermediate_size=1408)
        with torch.device("cuda"):
            plain = llama.MLP(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for p in plain.parameters():
        p.data.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.02)
    fused = copy.deepcopy(plain)
    fused.after_load()
    assert fused.interleaved == gate_up.BLOCK and plain.interleaved == 0
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch.testing.assert_close(_mlp_out(fused, x), _mlp_out(plain, x), rtol=2e-2, atol=2e-2)


def _mlp_out(mlp: llama.MLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP's output: what it adds to a residual stream of zeros."""
    stream = torch.zeros_like(x)
    after = RMSNorm(x.shape[1], 1e-5).to(device="cuda", dtype=torch.bfloat16)
    mlp(x, stream, after, None)
    return stream
